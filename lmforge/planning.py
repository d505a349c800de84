"""Showing a plan (accounting/plan.py) to people: tables in the terminal and a memory bar chart."""

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.dtypes import dtype_table
from lmforge.formatting import human_bytes, human_count, human_seconds

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
    m, st, f, mem, t = plan["model"], plan["setup"], plan["flops"], plan["memory"], plan["time"]
    parallel = f"dp {st['dp']} x tp {st['tp']} x pp {st['pp']} = {st['devices']} device(s)"
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value", justify="right")
    for name, value in [
        ("model", f"{m['family']}: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads "
                  f"({m['kv_heads']} kv), ffn {m['ffn_dim']}, vocab {m['vocab_size']:,}"),
        ("parameters", f"{human_count(m['parameters'])} ({m['parameters']:,})"),
        ("setup", f"batch {st['batch_size']} x seq {st['seq_len']} x accum {st['grad_accum']}, {st['precision']}, "
                  f"{st['optimizer']}, ZeRO {st['zero_stage']}, recompute {st['recompute']}, {st['attention']}"),
        ("parallelism", parallel),
        ("tokens per step", f"{st['tokens_per_step']:,}"),
        ("training FLOPs per token", f"{human_count(f['training_per_token'])} "
                                     f"(PaLM 6N+12LHQT: {human_count(f['palm_per_token'])})"),
        # N is not the parameter count above: say which parameters it leaves out
        ("6N", f"{human_count(f['six_n_per_token'])}, N = {human_count(m['matmul_parameters'])} matmul weights "
               f"(norms, biases, embedding lookups left out)"),
        ("training FLOPs per step", human_count(f["training_per_step"])),
    ]:
        head.add_row(name, value)
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

    table = Table(title="memory per device", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = mem["per_device_bytes"]
    for key, value in mem["breakdown_bytes"].items():
        if value:
            table.add_row(MEMORY_LABELS.get(key, key), human_bytes(value), f"{value / total:.1%}")
    table.add_row("total", human_bytes(total), "", style="bold")
    verdict = "fits" if mem["fits"] else "does NOT fit"
    table.add_row(f"device memory ({t['hardware']})", human_bytes(mem["device_memory_bytes"]),
                  f"{verdict} ({total / mem['device_memory_bytes']:.0%})", style="green" if mem["fits"] else "red")
    table.add_row("activations, Korthikanti et al. 16-bit", human_bytes(mem["activations_korthikanti_bytes"]),
                  f"{mem['activations_to_16bit_parameters_ratio']:.1f}x 16-bit params", style="dim")
    table.add_row("KV cache for inference at this batch x seq", human_bytes(mem["kv_cache_inference_bytes"]), "",
                  style="dim")
    console.print(table)

    timing = Table(title=f"time on {t['hardware']} at {t['assumed_mfu']:.0%} MFU", show_header=False,
                   title_justify="left")
    timing.add_column("what", style="bold")
    timing.add_column("value", justify="right")
    timing.add_row("peak per device", f"{human_count(t['peak_flops_per_device'])}FLOP/s ({t['matmul_dtype']})")
    timing.add_row("time per step", human_seconds(t["seconds_per_step"]))
    timing.add_row("throughput", f"{t['tokens_per_second']:,.0f} tokens/s")
    if t["tokens"]:
        timing.add_row(f"time for {human_count(t['tokens'])} tokens", human_seconds(t["seconds_for_tokens"]))
    console.print(timing)


def print_comparison(console: Console, comparison: dict) -> None:
    """The trainer's end-of-run table: each {"predicted", "measured"} pair and their ratio."""
    table = Table(title="predicted (plan) vs measured", title_justify="left")
    for column in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(column, justify="right" if column else "left")
    labels = {"tokens_per_s": "tokens/s (predicted at 100% MFU)", "mfu": "MFU", "hfu": "HFU (with recomputation)",
              "parameters_bytes": "parameters", "gradients_bytes": "gradients",
              "optimizer_states_bytes": "optimizer states",
              "activations_bytes": "saved for backward, one micro-batch", "peak_memory_bytes": "peak memory (CUDA)"}
    for key, row in comparison.items():
        predicted, measured = row["predicted"], row["measured"]
        if key.endswith("_bytes"):
            shown = (human_bytes(predicted), human_bytes(measured) if measured is not None else "-")
        elif key == "tokens_per_s":
            shown = (f"{predicted:,.0f}", f"{measured:,.0f}")
        else:
            shown = (f"{predicted:.0%}", f"{measured:.1%}")
        ratio = f"{measured / predicted:.3f}" if measured is not None and predicted else "-"
        table.add_row(labels[key], *shown, ratio)
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
    parts = [(MEMORY_LABELS.get(k, k), v) for k, v in mem["breakdown_bytes"].items() if v]
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
    ax.set_title(f"{name + ': ' if name else ''}{setup_label(plan)}\ndp {st['dp']} x tp {st['tp']} x pp {st['pp']} "
                 f"on {plan['time']['hardware']}: {human_bytes(mem['per_device_bytes'])} per device ({verdict})",
                 fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
