"""`lmforge eval MODEL --tasks ...`: glue from the command line to lmforge/eval/."""

import dataclasses

from lmforge.common.errors import LmforgeError


def cmd_eval(args) -> int:
    from lmforge.eval.generation import Sampling
    from lmforge.eval.metrics import table
    from lmforge.eval.run import evaluate, write_results
    from lmforge.eval.sandbox import network_isolation
    from lmforge.eval.tasks import GENERATION, TITLES, data_root, expand_tasks, load_prompts, load_questions
    from lmforge.generate.load import load_for_sampling
    from lmforge.parallel.world import resolve_device
    from lmforge.runs.load import results_folder

    tasks = expand_tasks(args.tasks.split(","))
    temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 0.8)
    if args.samples > 1 and temperature == 0:
        raise LmforgeError(f"--samples {args.samples} --temperature 0: greedy completions are all the same one; "
                           "give a temperature above 0 (Chen et al. 2021: 0.8 for pass@100)")
    sampling = Sampling(args.samples, temperature, args.top_p if temperature > 0 else None, args.seed)
    data_root()  # the data installed: one line saying what to install if not
    for task in tasks:  # every request file read before the model loads: a damaged one stops at once
        load_prompts(task, args.shots, 1) if task in GENERATION else load_questions(task, args.format, args.shots, 1)
    device = resolve_device(args.device, setting="--device")
    loaded, special = load_for_sampling(args.run, args.adapter, args.merge, args.dtype, device)
    out = results_folder(args.run, args.out)  # checked before the first item is scored
    if loaded.end_id is None:
        raise LmforgeError(f"{args.run}'s tokenizer has no end-of-text token ({loaded.cfg.data.end_token!r}): "
                           f"evaluation needs one (an empty context, a generation's end)")
    if any(t in ("codex_humaneval", "codex_mbpp") for t in tasks):
        print(f"code runs in lmforge's sandbox; network: {network_isolation()}")
    try:
        results = evaluate(loaded, tasks, args.format, args.shots, args.limit, args.max_new_tokens, special.stop_ids,
                           sampling=sampling)
    except KeyboardInterrupt:
        raise LmforgeError("interrupted before any item was scored: nothing written") from None
    interrupted = len(results) < len(tasks) or any(r["items"] < (args.limit or r["items"]) for r in results.values())
    settings = {"model": str(args.run), "tasks": tasks, "format": args.format, "shots": args.shots,
                "limit": args.limit, "dtype": args.dtype, "sampling": dataclasses.asdict(sampling)}
    print(table(results, TITLES))
    json_path, png_path = write_results(results, out, settings)
    if interrupted:
        raise LmforgeError(f"interrupted: the {sum(r['items'] for r in results.values())} items scored so far are "
                           f"in {json_path} and {png_path}")
    print(f"wrote {json_path} and {png_path}")
    return 0
