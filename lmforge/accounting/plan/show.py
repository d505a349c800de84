"""Showing a plan (accounting/plan.py) to people: tables in the terminal and a memory bar chart."""

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.dtypes import dtype_table
from lmforge.common.formatting import human_bytes, human_count, human_seconds

MEMORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "optimizer states",
    "weight_copies": "low-precision weight copies",
    "activations": "activations (saved for backward)",
    "logits": "logits + fp32 loss copy",
}


def print_plan(console: Console, plan: dict, title: str = "lmforge plan") -> None:
    if "decode" in plan:
        print_inference_plan(console, plan, title)
        return
    m, st, f, mem, t = plan["model"], plan["setup"], plan["flops"], plan["memory"], plan["time"]
    parallel = f"dp {st['dp']} x tp {st['tp']} x pp {st['pp']} = {st['devices']} device(s)"
    piped = plan.get("pipeline")
    steps = (f"{st['micro_batches']} micro-batches" if piped or st["micro_batches"] > 1
             else f"accum {st['grad_accum']}")
    if st["tp"] > 1:
        parallel += ", sequence parallel" if st["sequence_parallel"] else ", no sequence parallelism"
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value", justify="right")
    for name, value in [
        ("model", f"{m['family']}: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads "
                  f"({m['kv_heads']} kv), ffn {m['ffn_dim']}, vocab {m['vocab_size']:,}"),
        ("parameters", f"{human_count(m['parameters'])} ({m['parameters']:,})"),
        ("setup", f"batch {st['batch_size']} x seq {st['seq_len']} x {steps}, {st['precision']}, "
                  f"{st['optimizer']}, ZeRO {st['zero_stage']}, recompute {st['recompute']}, {st['attention']}"),
        ("parallelism", parallel),
        ("tokens per step", f"{st['tokens_per_step']:,}"),
        ("sent per step per rank", communication_line(plan["communication"])
         + ("; between stages: see below" if piped else "")),
        ("training FLOPs per token", f"{human_count(f['training_per_token'])} "
                                     f"(PaLM 6N+12LHQT: {human_count(f['palm_per_token'])})"),
        # N is not the parameter count above: say which parameters it leaves out
        ("6N", f"{human_count(f['six_n_per_token'])}, N = {human_count(m['matmul_parameters'])} matmul weights "
               f"(norms, biases, embedding lookups left out)"),
        ("training FLOPs per step", human_count(f["training_per_step"])),
    ]:
        head.add_row(name, value)
    if piped:
        split = ",".join(map(str, piped["split"]))
        head.add_row("pipeline", f"{piped['stages']} stages of {split} layers ({piped['split_source']}), "
                                 f"{piped['micro_batches']} micro-batches per step, {piped['schedule']}")
    if st["recompute"] != "none":  # without recomputation the hardware does exactly the model's FLOPs
        head.add_row("hardware FLOPs per token", f"{human_count(f['hardware_per_token'])} "
                                                 f"(with {st['recompute']} recomputation)")
    if "lora" in plan:
        lora = plan["lora"]
        saved = lora["saved_bytes"]
        head.add_row("LoRA", f"rank {lora['rank']} on {lora['targets']}: {human_count(lora['trainable_parameters'])} "
                             f"trainable ({lora['trainable_fraction']:.2%} of the parameters)")
        head.add_row("saved vs full fine-tuning", f"gradients {human_bytes(saved['gradients'])}, optimizer states "
                                                   f"{human_bytes(saved['optimizer_states'] + saved['master_weights'])} "
                                                   f"(activations: the same)")
    console.print(head)

    title = f"memory per device: pipeline stage {piped['largest_stage']}, the largest" if piped else "memory per device"
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = mem["per_device_bytes"]
    for key, value in mem["breakdown_bytes"].items():
        if value:
            table.add_row(MEMORY_LABELS.get(key, key), human_bytes(value), f"{value / total:.1%}")
    table.add_row("total", human_bytes(total), "", style="bold")
    add_headroom_rows(table, total, mem, t["hardware"])
    table.add_row("activations, Korthikanti et al. 16-bit", human_bytes(mem["activations_korthikanti_bytes"]),
                  f"{mem['activations_to_16bit_parameters_ratio']:.1f}x 16-bit params", style="dim")
    table.add_row("KV cache for inference at this batch x seq", human_bytes(mem["kv_cache_inference_bytes"]), "",
                  style="dim")
    console.print(table)
    if piped:
        print_stages(console, piped)

    timing = Table(title=f"time on {t['hardware']} at {t['assumed_mfu']:.0%} MFU", show_header=False,
                   title_justify="left")
    timing.add_column("what", style="bold")
    timing.add_column("value", justify="right")
    timing.add_row("peak per device", f"{human_count(t['peak_flops_per_device'])}FLOP/s ({t['matmul_dtype']})")
    timing.add_row("time per step", human_seconds(t["seconds_per_step"]))
    if piped:
        add_bubble_rows(timing, piped, t["assumed_mfu"])
    timing.add_row("throughput", f"{t['tokens_per_second']:,.0f} tokens/s")
    budget = plan["budget"]
    source = "" if t["tokens_source"] == "given" else " (Chinchilla's 20 per parameter: no --tokens)"
    timing.add_row(f"time for {human_count(t['tokens'])} tokens{source}",
                   f"{human_seconds(t['seconds_for_tokens'])} on {st['devices']} device(s)")
    timing.add_row("training FLOPs for them", f"{budget['training_flops']:.3e}")
    timing.add_row("device-hours", f"{budget['device_hours']:,.0f}")
    if budget["cost"] is not None:
        timing.add_row(f"cost at {budget['price_per_device_hour']:g} per device-hour", f"{budget['cost']:,.0f}")
    console.print(timing)


def print_stages(console: Console, piped: dict) -> None:
    """plan["pipeline"]'s stages, one row each: what each device of that stage holds."""
    table = Table(title=f"pipeline stages ({piped['schedule']}, {piped['micro_batches']} micro-batches)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("stage", "layers", "weights", "grads", "optimizer", "activations x in flight", "total",
                   "sent/step"):
        table.add_column(column, justify="right", no_wrap=True)
    for d in piped["stages_detail"]:
        parts = d["breakdown_bytes"]
        first, last = d["layers"]
        table.add_row(str(d["stage"]), f"{first}-{last}" if last > first else str(first),
                      human_bytes(parts["parameters"]), human_bytes(parts["gradients"]),
                      human_bytes(parts["master_weights"] + parts["optimizer_states"]),
                      f"{human_bytes(d['activations_per_micro_batch_bytes'])} x {d['micro_batches_in_flight']}",
                      human_bytes(d["total_bytes"]), human_bytes(sum(d["sent_bytes_per_step"].values())),
                      style="bold" if d["stage"] == piped["largest_stage"] else None)
    Console(file=console.file, width=max(console.width, 120)).print(table)


def add_bubble_rows(timing: Table, piped: dict, assumed_mfu: float) -> None:
    """The bubble by its formula, the slowest stage that sets the pace, and the MFU that leaves."""
    p, m = piped["stages"], piped["micro_batches"]
    slowest = piped["stages_detail"][piped["slowest_stage"]]
    timing.add_row("pipeline step", f"(m + p - 1) x slowest stage = {m + p - 1} x "
                                    f"{human_seconds(slowest['seconds_per_micro_batch'])} (stage {slowest['stage']}); "
                                    f"no bubble: {human_seconds(piped['ideal_seconds_per_step'])}")
    timing.add_row("bubble", f"(p - 1) / (m + p - 1) = {p - 1}/{m + p - 1} = {piped['bubble_fraction']:.1%} of the "
                             f"step idle")
    timing.add_row("MFU at best", f"{piped['best_mfu']:.1%} = {assumed_mfu:.0%} x no bubble / pipeline step: the "
                                  f"bubble and unequal stages cost {assumed_mfu - piped['best_mfu']:.1%}")


def communication_line(c: dict) -> str:
    """accounting/comm.py's count in one line."""
    if not c["sent_bytes"]:
        return "nothing (one data-parallel rank)"
    paper = "3" if c["strategy"] in ("zero3", "fsdp") else "2"
    return (f"{human_bytes(c['sent_bytes'])} ({c['strategy']}: (N-1)/N x {c['ring_elements']:,} elements of "
            f"{c['element_bytes']} bytes, ring; paper {paper}Psi = {human_bytes(c['paper_bytes'])})")


def add_headroom_rows(table: Table, total: float, mem: dict, hardware: str) -> None:
    """The reserve as its own line, then the device's memory and whether total + reserve fits."""
    reserve = mem["reserve_bytes"]
    table.add_row("reserve (--reserve: CUDA context, fragmentation)", human_bytes(reserve), "", style="dim")
    verdict = "fits" if mem["fits"] else "does NOT fit"
    table.add_row(f"device memory ({hardware}, as the device reports it)", human_bytes(mem["device_memory_bytes"]),
                  f"{verdict} ({(total + reserve) / mem['device_memory_bytes']:.0%})",
                  style="green" if mem["fits"] else "red")


def print_inference_plan(console: Console, plan: dict, title: str) -> None:
    m, st, mem, pre, dec, hw = (plan[k] for k in ("model", "setup", "memory", "prefill", "decode", "hardware"))
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value", justify="right")
    quantised = f", one fp16 scale per {st['group_size']} weights" if st["weights"] in ("int8", "int4") else ""
    for name, value in [
        ("model", f"{m['family']}: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads "
                  f"({m['kv_heads']} kv, head dim {m['head_dim']}), vocab {m['vocab_size']:,}"),
        ("parameters", f"{human_count(m['parameters'])} ({m['parameters']:,})"),
        ("setup", f"batch {st['batch_size']} x context {st['seq_len']:,}, weights {st['weights']}{quantised}, "
                  f"KV cache {st['kv_dtype']}, tp {st['tp']}"),
        ("KV cache per token", f"{human_bytes(mem['kv_cache_per_token_bytes'])} per device "
                               f"(2 x {m['layers']} layers x {m['kv_heads']} kv heads x {m['head_dim']} / tp)"),
    ]:
        head.add_row(name, value)
    console.print(head)

    table = Table(title="memory per device", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = mem["per_device_bytes"]
    rows = [(f"block linear weights ({st['weights']})", mem["weights_bytes"]["block_linear"]),
            ("quantisation scales", mem["weights_bytes"]["scales"]),
            ("embedding, LM head, norms (16-bit)", mem["weights_bytes"]["embedding_head_norms"]),
            (f"KV cache ({st['batch_size']} x {st['seq_len']:,} tokens)", mem["kv_cache_bytes"])]
    for label, value in rows:
        if value:
            table.add_row(label, human_bytes(value), f"{value / total:.1%}")
    table.add_row("total", human_bytes(total), "", style="bold")
    add_headroom_rows(table, total, mem, hw["name"])
    table.add_row("largest batch that fits at this context", f"{mem['largest_batch']:,}", "", style="bold")
    console.print(table)

    timing = Table(title=f"time on {hw['name']}", show_header=False, title_justify="left")
    timing.add_column("what", style="bold")
    timing.add_column("value", justify="right")
    timing.add_row("prefill", f"{human_count(pre['flops'])}FLOP, {human_seconds(pre['seconds'])} at "
                              f"{st['mfu']:.0%} of {human_count(hw['peak_flops'])}FLOP/s ({pre['bound']}-bound)")
    timing.add_row("decode step reads", f"{human_bytes(dec['bytes_per_step'])} per device "
                                        f"at {human_bytes(hw['memory_bandwidth'])}/s")
    timing.add_row("decode time per step", f"{human_seconds(dec['seconds_per_step'])} ({dec['bound']}-bound)")
    timing.add_row("decode tokens/s", f"{dec['tokens_per_second']:,.1f} ({dec['tokens_per_second_per_device']:,.1f} "
                                      f"per device)")
    console.print(timing)


# The columns of `--compare`: (label, how to show it) for each kind of plan
TRAINING_COLUMNS = [
    ("memory/device", lambda p: human_bytes(p["memory"]["per_device_bytes"])),
    ("fits", lambda p: "yes" if p["memory"]["fits"] else "NO"),
    ("time/step", lambda p: human_seconds(p["time"]["seconds_per_step"])),
    # time is at the assumed MFU, which counts no recomputation: say what recomputation adds
    ("recompute FLOPs", lambda p: f"+{p['flops']['hardware_per_token'] / p['flops']['training_per_token'] - 1:.0%}"),
    ("tokens/s", lambda p: f"{p['time']['tokens_per_second']:,.0f}"),
    ("bubble", lambda p: f"{p['pipeline']['bubble_fraction']:.0%}" if "pipeline" in p else "-"),
    ("devices", lambda p: str(p["setup"]["devices"])),
    ("device-hours", lambda p: f"{p['budget']['device_hours']:,.0f}"),
]
INFERENCE_COLUMNS = [
    ("weight bytes", lambda p: human_bytes(sum(p["memory"]["weights_bytes"].values()))),
    ("KV cache", lambda p: human_bytes(p["memory"]["kv_cache_bytes"])),
    ("fits", lambda p: "yes" if p["memory"]["fits"] else "NO"),
    ("largest batch", lambda p: f"{p['memory']['largest_batch']:,}"),
    ("prefill", lambda p: human_seconds(p["prefill"]["seconds"])),
    ("decode step", lambda p: human_seconds(p["decode"]["seconds_per_step"])),
    ("tokens/s/device", lambda p: f"{p['decode']['tokens_per_second_per_device']:,.1f}"),
]


def compare_label(plan: dict, varying: list[str]) -> str:
    """What sets a plan apart in a comparison: the values of the options that vary."""
    st = plan["setup"]
    return ", ".join(f"{name.replace('_', ' ')} {st[name]}" for name in varying)


def print_comparison_table(console: Console, plans: list[dict], varying: list[str], title: str) -> None:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    columns = INFERENCE_COLUMNS if "decode" in plans[0] else TRAINING_COLUMNS
    for name in varying:
        table.add_column(name.replace("_", " "), justify="right", no_wrap=True)
    for label, _ in columns:
        table.add_column(label, justify="right", no_wrap=True)
    for plan in plans:
        fits = plan["memory"]["fits"]
        table.add_row(*(str(plan["setup"][name]) for name in varying), *(show(plan) for _, show in columns),
                      style=None if fits else "red")
    # one line per setup, even where the output is a narrow pipe
    Console(file=console.file, width=max(console.width, 150)).print(table)


def memory_parts(plan: dict) -> list[tuple[str, float]]:
    """A plan's memory per device by part (training or inference), the reserve last."""
    mem = plan["memory"]
    if "decode" in plan:
        parts = [("weights", sum(mem["weights_bytes"].values())), ("KV cache", mem["kv_cache_bytes"])]
    else:
        parts = [(MEMORY_LABELS.get(k, k), v) for k, v in mem["breakdown_bytes"].items() if v]
    return [*parts, ("reserve (CUDA context, fragmentation)", mem["reserve_bytes"])]


def plot_comparison(plans: list[dict], varying: list[str], png_path: str | Path, name: str = "") -> None:
    """One stacked bar of memory per device for each setup, with each device's capacity marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for plan in plans for label, _ in memory_parts(plan)))  # in order, once
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(plans)), dpi=120)
    names = [compare_label(plan, varying) for plan in plans]
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(plans)
    for index, label in enumerate(labels):
        values = [dict(memory_parts(plan)).get(label, 0) / 2**30 for plan in plans]
        ax.barh(names, values, left=left, color=colors[index % 10], label=label)
        left = [a + b for a, b in zip(left, values)]
    for row, plan in enumerate(plans):
        ax.plot([plan["memory"]["device_memory_bytes"] / 2**30] * 2, [row - 0.4, row + 0.4], color="black",
                linestyle="--")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per device (dashed: device memory)")
    kind = "inference" if "decode" in plans[0] else "training"
    ax.set_title(f"{name + ': ' if name else ''}{kind} memory per device, by setup", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(plans) < 6 else -0.12), ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def print_comparison(console: Console, comparison: dict) -> None:
    """The trainer's end-of-run table: each {"predicted", "measured"} pair and their ratio."""
    table = Table(title="predicted (plan) vs measured", title_justify="left")
    for column in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(column, justify="right" if column else "left")
    labels = {"tokens_per_s": "tokens/s (predicted at 100% MFU)", "mfu": "MFU", "hfu": "HFU (with recomputation)",
              "parameters_bytes": "parameters", "gradients_bytes": "gradients",
              "optimizer_states_bytes": "optimizer states",
              "activations_bytes": "saved for backward, one micro-batch", "peak_memory_bytes": "peak memory (CUDA)",
              "sent_bytes_per_step": "sent per step per rank (collectives)",
              "activations_in_flight_bytes": "saved for backward, peak alive at once"}
    for key, row in comparison.items():
        predicted, measured = row["predicted"], row["measured"]
        if key.startswith("stage "):  # a pipeline stage's row: "stage 1 activations_bytes"
            _, stage, name = key.split(" ", 2)
            label = f"stage {stage}: {labels[name]}"
        else:
            label = labels[key]
        if "_bytes" in key:
            shown = (human_bytes(predicted), human_bytes(measured) if measured is not None else "-")
        elif key == "tokens_per_s":
            shown = (f"{predicted:,.0f}", f"{measured:,.0f}")
        else:
            shown = (f"{predicted:.0%}", f"{measured:.1%}")
        ratio = f"{measured / predicted:.3f}" if measured is not None and predicted else "-"
        table.add_row(label, *shown, ratio)
    console.print(table)


def print_dtypes(console: Console) -> None:
    table = Table(title="floating-point formats (from torch.finfo)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("dtype", "bits", "bytes", "exp", "mant", "max", "min normal", "eps"):
        table.add_column(column, justify="right" if column != "dtype" else "left", no_wrap=True)
    for d in dtype_table():
        table.add_row(d.name, str(d.bits), str(d.bytes), str(d.exponent_bits), str(d.mantissa_bits),
                      f"{d.max:.4g}".replace("e+", "e"), f"{d.smallest_normal:.3g}", f"{d.eps:.3g}")
    console.print(table)


def setup_label(plan: dict) -> str:
    """The model and setup of a plan in two lines, for a figure's title."""
    m, st = plan["model"], plan["setup"]
    return (f"{m['family']}, {m['layers']} layers, d_model {m['d_model']}, {human_count(m['parameters'])} parameters\n"
            f"batch {st['batch_size']} x seq {st['seq_len']}, {st['precision']}, {st['optimizer']}, "
            f"ZeRO {st['zero_stage']}, recompute {st['recompute']}, {st['attention']} attention")


def plot_memory(plan: dict, png_path: str | Path, name: str = "") -> None:
    """A stacked bar of memory per device by part, beside the device's capacity; the title names
    the model (`name`, e.g. its preset) and the setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = plan["memory"]
    parts = memory_parts(plan)
    scale, unit = (2**30, "GiB") if mem["per_device_bytes"] >= 2**30 else (2**20, "MiB")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    left = 0.0
    colors = plt.get_cmap("tab10").colors
    for index, (label, value) in enumerate(parts):
        ax.barh(["per device"], [value / scale], left=left, color=colors[index % 10],
                label=f"{label}: {human_bytes(value)}")
        left += value / scale
    ax.axvline(mem["device_memory_bytes"] / scale, color="black", linestyle="--",
               label=f"device memory: {human_bytes(mem['device_memory_bytes'])}")
    ax.set_xlabel(unit)
    verdict = "fits" if mem["fits"] else "does NOT fit"
    st = plan["setup"]
    if "decode" in plan:  # an inference plan
        m = plan["model"]
        where = (f"{m['family']}, {m['layers']} layers, {human_count(m['parameters'])} parameters, serving\n"
                 f"batch {st['batch_size']} x context {st['seq_len']}, weights {st['weights']}, KV {st['kv_dtype']}, "
                 f"tp {st['tp']} on {plan['hardware']['name']}")
    else:
        where = (f"{setup_label(plan)}\ndp {st['dp']} x tp {st['tp']} x pp {st['pp']} on {plan['time']['hardware']}")
    ax.set_title(f"{name + ': ' if name else ''}{where}: {human_bytes(mem['per_device_bytes'])} per device ({verdict})",
                 fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
