"""The tables beside a training plan's (show.py): an inference plan's (plan/inference.py: what it
serves, its memory per device and the largest batch that fits, prefill and decode time), the table
of `lmforge plan --compare` (one row per setup, the options that vary and what each setup costs,
training or inference), and the trainer's end-of-run table: what the plan predicted beside what the
run measured (train/summary.py pairs them)."""

from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.plan.show import facts_table, memory_table, wide
from lmforge.common.errors import human_bytes, human_count, human_seconds


# -- an inference plan -----------------------------------------------------------------------------
def print_inference_plan(console: Console, plan: dict, title: str) -> None:
    console.print(inference_head_table(plan, title))
    console.print(inference_memory_table(plan))
    console.print(inference_time_table(plan))


def inference_head_table(plan: dict, title: str) -> Table:
    """The model, the setup, and the KV cache one token adds."""
    m, st, mem = plan["model"], plan["setup"], plan["memory"]
    quantised = f", one fp16 scale per {st['group_size']} weights" if st["weights"] in ("int8", "int4") else ""
    return facts_table(title, [
        ("model", f"{m['family']}: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads "
                  f"({m['kv_heads']} kv, head dim {m['head_dim']}), vocab {m['vocab_size']:,}"),
        ("parameters", f"{human_count(m['parameters'])} ({m['parameters']:,})"),
        ("setup", f"batch {st['batch_size']} x context {st['seq_len']:,}, weights {st['weights']}{quantised}, "
                  f"KV cache {st['kv_dtype']}, tp {st['tp']}"),
        ("KV cache per token", f"{human_bytes(mem['kv_cache_per_token_bytes'])} per device "
                               f"(2 x {m['layers']} layers x {m['kv_heads']} kv heads x {m['head_dim']} / tp)"),
    ])


def inference_memory_table(plan: dict) -> Table:
    """Weights and KV cache per device, whether they fit, and the largest batch that does."""
    st, mem = plan["setup"], plan["memory"]
    parts = [(f"block linear weights ({st['weights']})", mem["weights_bytes"]["block_linear"]),
             ("quantisation scales", mem["weights_bytes"]["scales"]),
             ("embedding, LM head, norms (16-bit)", mem["weights_bytes"]["embedding_head_norms"]),
             (f"KV cache ({st['batch_size']} x {st['seq_len']:,} tokens)", mem["kv_cache_bytes"])]
    table = memory_table("memory per device", parts, mem, plan["hardware"]["name"])
    table.add_row("largest batch that fits at this context", f"{mem['largest_batch']:,}", "", style="bold")
    return table


def inference_time_table(plan: dict) -> Table:
    """Prefill (compute-bound) and a decode step (memory-bound, as a rule) on the plan's hardware;
    on this machine also the decode step by the measured roofline (accounting/roofline/decode.py)."""
    st, pre, dec, hw = plan["setup"], plan["prefill"], plan["decode"], plan["hardware"]
    return facts_table(f"time on {hw['name']}", [
        ("prefill", f"{human_count(pre['flops'])}FLOP, {human_seconds(pre['seconds'])} at "
                    f"{st['mfu']:.0%} of {human_count(hw['peak_flops'])}FLOP/s ({pre['bound']}-bound)"),
        ("decode step reads", f"{human_bytes(dec['bytes_per_step'])} per device "
                              f"at {human_bytes(hw['memory_bandwidth'])}/s"),
        ("decode time per step", f"{human_seconds(dec['seconds_per_step'])} ({dec['bound']}-bound)"),
        ("decode tokens/s", f"{dec['tokens_per_second']:,.1f} ({dec['tokens_per_second_per_device']:,.1f} "
                            f"per device)"),
        *decode_roofline_rows(plan.get("decode_roofline")),
    ])


def decode_roofline_rows(predicted: dict | None) -> list[tuple[str, str]]:
    """The roofline's decode step: time, tokens/s, and each class's time and bound."""
    if predicted is None:
        return []
    if "none" in predicted:
        return [("decode by the roofline", f"not predicted: {predicted['none']}")]
    step = predicted["seconds_per_step"]
    classes = ", ".join(f"{name} {human_seconds(row['seconds'])} ({row['bound']}, "
                        f"{row['launch_s'] / row['seconds']:.0%} launches)"
                        for name, row in predicted["classes"].items() if row["seconds"])
    return [("decode by the roofline", f"{human_seconds(step)} per step, {predicted['tokens_per_second']:,.1f} "
                                       f"tokens/s (traced step, measured roof)"),
            ("  by class", classes)]


# -- lmforge plan --compare -------------------------------------------------------------------------
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
    wide(console, 150).print(table)


# -- predicted vs measured ----------------------------------------------------------------------------
def print_comparison(console: Console, comparison: dict) -> None:
    """The trainer's end-of-run table: each {"predicted", "measured"} pair and their ratio."""
    table = Table(title="predicted (plan) vs measured", title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column else "left")
    for row in comparison_rows(comparison):
        table.add_row(*row)
    console.print(table)


COLUMNS = ("", "predicted", "measured", "measured / predicted")


def comparison_rows(comparison: dict) -> list[tuple[str, str, str, str]]:
    """Each {"predicted", "measured"} pair as the table shows it (`lmforge report` writes the same rows)."""
    labels = {"step_seconds": "step time (roofline)", "mfu": "MFU", "hfu": "HFU (with recomputation)",
              "parameters_bytes": "parameters", "gradients_bytes": "gradients",
              "optimizer_states_bytes": "optimizer states",
              "activations_bytes": "saved for backward, one micro-batch", "peak_memory_bytes": "peak memory (CUDA)",
              "sent_bytes_per_step": "sent per step per rank (collectives)",
              "tp_sent_bytes_per_step": "sent per step per rank (tensor-parallel activations)",
              "cp_sent_bytes_per_step": "sent per step per rank (context-parallel ring)",
              "activations_in_flight_bytes": "saved for backward, peak alive at once"}
    rows = []
    for key, row in comparison.items():
        predicted, measured = row["predicted"], row["measured"]
        if key.startswith("stage "):  # a pipeline stage's row: "stage 1 activations_bytes"
            _, stage, name = key.split(" ", 2)
            label = f"stage {stage}: {labels[name]}"
        else:
            label = labels[key]
        if "_bytes" in key:
            shown = (human_bytes(predicted), human_bytes(measured) if measured is not None else "not measured")
        elif key == "step_seconds":
            shown = (human_seconds(predicted), human_seconds(measured))
        else:
            shown = (f"{predicted:.0%}", f"{measured:.1%}")
        ratio = f"{measured / predicted:.3f}" if measured is not None and predicted else "-"
        rows.append((label, *shown, ratio))
    return rows
