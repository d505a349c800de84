"""The plan's charts (matplotlib, imported when a chart is drawn): its memory as bar charts, one
setup's parts beside the device's capacity (`lmforge plan --plot`) or one bar per setup of a
--compare; and the roofline's picture, the roof with each operation class as a point (`lmforge plan
--roofline out.png`)."""

from pathlib import Path

from lmforge.accounting.plan.tables import compare_label
from lmforge.accounting.roofline import rate_dtype
from lmforge.accounting.plan.show import labelled_parts
from lmforge.common.errors import human_bytes, human_count


def memory_parts(plan: dict) -> list[tuple[str, float]]:
    """A plan's memory per device by part (training or inference), the reserve last."""
    mem = plan["memory"]
    if "decode" in plan:
        parts = [("weights", sum(mem["weights_bytes"].values())), ("KV cache", mem["kv_cache_bytes"])]
    else:
        parts = labelled_parts(mem["breakdown_bytes"])
    return [*parts, ("reserve (CUDA context, fragmentation)", mem["reserve_bytes"])]


def plot_comparison(plans: list[dict], varying: list[str], png_path: str | Path, name: str = "") -> None:
    """One stacked bar of memory per device for each setup, with each device's capacity marked."""
    plt = pyplot()
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
    save(plt, fig, png_path)


def setup_label(plan: dict) -> str:
    """The model and setup of a plan in two lines, for a figure's title."""
    m, st = plan["model"], plan["setup"]
    return (f"{m['family']}, {m['layers']} layers, d_model {m['d_model']}, {human_count(m['parameters'])} parameters\n"
            f"batch {st['batch_size']} x seq {st['seq_len']}, {st['precision']}, {st['optimizer']}, "
            f"ZeRO {st['zero_stage']}, recompute {st['recompute']}, {st['attention']} attention")


def plot_memory(plan: dict, png_path: str | Path, name: str = "") -> None:
    """A stacked bar of memory per device by part, beside the device's capacity; the title names
    the model (`name`, e.g. its preset) and the setup."""
    plt = pyplot()
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
    ax.set_title(memory_title(plan, name), fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    save(plt, fig, png_path)


def memory_title(plan: dict, name: str = "") -> str:
    """plot_memory's title: the model (`name`, e.g. its preset), the setup, the total and whether it fits."""
    mem, st = plan["memory"], plan["setup"]
    verdict = "fits" if mem["fits"] else "does NOT fit"
    if "decode" in plan:  # an inference plan
        m = plan["model"]
        where = (f"{m['family']}, {m['layers']} layers, {human_count(m['parameters'])} parameters, serving\n"
                 f"batch {st['batch_size']} x context {st['seq_len']}, weights {st['weights']}, KV {st['kv_dtype']}, "
                 f"tp {st['tp']} on {plan['hardware']['name']}")
    else:
        where = (f"{setup_label(plan)}\ndp {st['dp']} x tp {st['tp']} x pp {st['pp']} on {plan['time']['hardware']}")
    return f"{name + ': ' if name else ''}{where}: {human_bytes(mem['per_device_bytes'])} per device ({verdict})"


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed): every chart of accounting/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, png_path: str | Path) -> None:
    """Write `fig` laid out tight, and free it."""
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def plot_roofline(plan: dict, path, name: str = "", measured: dict | None = None) -> None:
    """Log-log arithmetic intensity (FLOP/byte) against FLOP/s: the roof min(peak, intensity x
    bandwidth) at the best measured matmul rate, and each predicted class as a point; `measured`
    ({class: seconds}, from bench/step_time.py's profile) adds the measured points beside them."""
    plt = pyplot()
    r = plan["roofline"]
    dtype, bandwidth = rate_dtype(plan["time"]["matmul_dtype"]), r["bandwidth_bytes_per_second"]
    peak = r["best_matmul_flops_per_second"][dtype]
    knee = peak / bandwidth
    classes = {k: v for k, v in plan["roofline"]["classes"].items() if v["flops"]}
    low = min([knee / 100] + [v["intensity_flops_per_byte"] / 3 for v in classes.values()])
    high = max([knee * 100] + [v["intensity_flops_per_byte"] * 3 for v in classes.values()])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs = [low, knee, high]
    ax.plot(xs, [min(peak, x * bandwidth) for x in xs], color="black",
            label=f"roof: {human_count(peak)}FLOP/s ({dtype} matmul), {human_bytes(bandwidth)}/s")
    for i, (label, row) in enumerate(classes.items()):
        color = f"C{i}"
        ax.scatter([row["intensity_flops_per_byte"]], [row["achieved_flops_per_second"]], color=color,
                   label=f"{label} (predicted)")
        if measured and measured.get(label):
            ax.scatter([row["intensity_flops_per_byte"]], [row["flops"] / measured[label]], color=color,
                       marker="x", label=f"{label} (measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"roofline: {name}" if name else "roofline")
    ax.legend(fontsize=7, loc="lower right")
    save(plt, fig, path)
