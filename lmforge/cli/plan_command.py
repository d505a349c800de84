"""`lmforge plan`: what a setup costs before it runs (lmforge/accounting/plan/), as tables, JSON or charts."""

from pathlib import Path

from lmforge.common.errors import LmforgeError
from lmforge.config import DEFAULT_PRESET, make_config


def cmd_plan(args) -> int:
    """`lmforge plan`: every check first (bad input is one line before anything is written), then the
    plans, then the tables or JSON and the charts."""
    from rich.console import Console

    from lmforge.accounting.plan.show import print_dtypes
    from lmforge.cli.training import retain_freed_memory

    console = Console()
    if args.dtypes:
        print_dtypes(console)
        return 0
    retain_freed_memory()  # the roofline is measured under the malloc settings lmforge train runs with
    plans, varying, note, name = _plans(args)
    _show(console, plans, varying, name, note, args)
    return 0


def _plans(args) -> tuple[list[dict], list, str, str]:
    """The plans of the config and the options (several with --compare), checked; with --scaling, the
    loss each buys. Also the options that vary, the line --solve adds and the config's name."""
    import itertools

    from lmforge.cli.plan_options import Planner, alias_changes, read_lists

    if args.plot and not Path(args.plot).parent.is_dir():
        raise LmforgeError(f"--plot {args.plot}: folder {Path(args.plot).parent} does not exist; create it "
                           f"or pick another path")
    if args.roofline and (args.compare or args.inference or not Path(args.roofline).parent.is_dir()):
        raise LmforgeError(f"--roofline {args.roofline}: " + ("one training plan at a time (not with --compare or "
                           "--inference)" if args.compare or args.inference else
                           f"folder {Path(args.roofline).parent} does not exist"))
    if args.run is not None and args.inference:
        _stored_dtypes(args)
    lists = read_lists(args)
    setups = [dict(zip(lists, values)) for values in itertools.product(*lists.values())]
    # the config checked with the first setup's settings (the sequence apart: its own line below)
    first = [f"{key}={value}" for key, value in ({} if args.inference else alias_changes(args, setups[0])).items()
             if key not in ("train.seq_len", "parallel.sequence_parallel", "optim.name")]  # the planner's to check
    cfg, name = _plan_config(args, [*args.overrides, *first])
    for seq_len in lists.get("seq_len", []):
        if seq_len > cfg.model.max_seq_len:
            raise LmforgeError(f"--seq-len {seq_len} is beyond the model's {cfg.model.max_seq_len} positions: "
                               f"lower it, or add model.max_seq_len={seq_len}")
    trace = None
    if args.roofline:  # the step traced on the trainer's own engine
        from lmforge.train.roofline import one_process_engine as trace
    planner = Planner(cfg, args, trace)
    plans = [planner.plan(chosen) for chosen in setups]  # LmforgeError for bad input, before anything is written
    note = ""
    if args.solve:
        plans[0], note = planner.solve(setups[0])
    if args.roofline and "roofline" not in plans[0]:
        raise LmforgeError(f"--roofline {args.roofline}: no roofline for this setup (tensor or pipeline "
                           f"parallelism, LoRA: not predicted yet)")
    if args.inference:
        _add_decode_roofline(cfg, plans, args)
    if args.scaling:  # the loss the budget buys (accounting/scaling.py)
        from lmforge.accounting.scaling import predicted_loss, read_fit
        from lmforge.accounting.shapes import model_shapes

        fit = read_fit(args.scaling)
        for plan in plans:
            plan["scaling"] = predicted_loss(fit, model_shapes(cfg.model).matmul_weights, plan["time"]["tokens"])
    return plans, [name for name, values in lists.items() if len(values) > 1], note, name


def _add_decode_roofline(cfg, plans: list[dict], args) -> None:
    """Each inference plan on this machine gets its decode step by the measured roofline
    (accounting/roofline/decode.py) beside the bandwidth bound (the roof measured only if one is traced)."""
    from lmforge.accounting.roofline.decode import plan_decode, untraced
    from lmforge.train.roofline import decode_step

    mine, roof = [plan for plan in plans if plan["setup"]["hardware"] == "this"], None
    if any(untraced(plan) is None for plan in mine):
        from lmforge.accounting.roofline.decode import decode_roof, this_decode_measurements
        from lmforge.accounting.roofline.measure import this_roof
        from lmforge.parallel.world import resolve_device

        device = resolve_device("auto")
        roof = decode_roof(this_roof(device, remeasure=args.remeasure),
                           this_decode_measurements(decode_step, device, remeasure=args.remeasure))
    for plan in mine:  # an untraced setup's: {"none": why}
        plan["decode_roofline"] = plan_decode(decode_step, cfg.model, plan, roof)


def _show(console, plans: list[dict], varying: list, name: str, note: str, args) -> None:
    """The charts asked for written first (--plot: the memory, or --compare's bars; --roofline), then
    the plan (--compare: every plan, as one table) as JSON or tables, and where the charts went."""
    import json

    from lmforge.accounting.plan.chart import plot_comparison, plot_memory
    from lmforge.accounting.plan.tables import print_comparison_table
    from lmforge.accounting.plan.show import print_plan
    from lmforge.common.folders import write_file_staged

    charts = {}  # what each chart is: (its path, what draws it)
    if args.plot and args.compare:
        charts["comparison chart"] = (args.plot, lambda path: plot_comparison(plans, varying, path, name=name))
    elif args.plot:
        charts["memory chart"] = (args.plot, lambda path: plot_memory(plans[0], path, name=name))
    if args.roofline:
        from lmforge.accounting.plan.chart import plot_roofline

        charts["roofline chart"] = (args.roofline, lambda path: plot_roofline(plans[0], path, name=name))
    for path, draw in charts.values():
        write_file_staged(Path(path), draw)
    if args.json:
        print(json.dumps(plans if args.compare else plans[0], indent=2))
        return
    if args.compare:
        print_comparison_table(console, plans, varying, title=f"lmforge plan --compare: {name}")
    else:
        print_plan(console, plans[0], title=f"lmforge plan{' --inference' if args.inference else ''}: {name}")
    if note:
        console.print(note)
    for what, (path, _) in charts.items():
        console.print(f"{what}: {path}")


def _plan_config(args, overrides: list[str]):
    """The config `lmforge plan` plans and its name: a preset's, or a folder's (a run's config.yaml, a
    Hugging Face folder's model), then --config and the overrides."""
    if args.run is None:
        name = args.model or DEFAULT_PRESET
        return make_config(name, args.config, overrides), name
    if args.model:
        raise LmforgeError(f"give RUN ({args.run}) or --model ({args.model}), not both")
    from lmforge.cli.plan_options import configure
    from lmforge.config import apply_dict, parse_override, read_yaml
    from lmforge.runs.load import folder_config

    cfg = folder_config(args.run)
    if args.config:
        apply_dict(cfg, read_yaml(args.config), origin=args.config)
    cfg = configure(cfg, dict(map(parse_override, overrides)))
    return cfg, Path(args.run).name


def _stored_dtypes(args) -> None:
    """With --inference a folder's stored dtype is the default --weights and --kv-dtype: what
    `lmforge generate` holds."""
    from lmforge.accounting.plan.inference import KV_FORMATS
    from lmforge.runs.load import DTYPES, folder_dtype

    stored = {dtype: name for name, dtype in DTYPES.items()}.get(folder_dtype(args.run), "fp32")
    args.weights = args.weights or stored
    args.kv_dtype = args.kv_dtype or (stored if stored in KV_FORMATS else "bf16")
