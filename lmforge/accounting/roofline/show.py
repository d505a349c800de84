"""The plan's step time from the roofline (accounting/roofline/__init__.py): one row per operation class with
its time, share, FLOPs, bytes, arithmetic intensity, achieved FLOP/s and the bound it hits; and
the picture of the roof with each class as a point (`lmforge plan --roofline out.png`)."""

from rich.table import Table

from lmforge.common.errors import human_bytes, human_count, human_seconds


def roofline_table(plan: dict) -> Table:
    """plan["roofline"] as a table: each class, then the step and its tokens/s."""
    r = plan["roofline"]
    table = Table(title=f"predicted step time from the {r['roof_source']} roofline of {r['roof']}",
                  title_justify="left")
    for column in ("", "time", "share", "FLOPs", "bytes", "FLOP/byte", "achieved FLOP/s", "launches", "bound"):
        table.add_column(column, justify="right" if column else "left", no_wrap=True)
    step = r["seconds_per_step"]
    for name, row in r["classes"].items():
        table.add_row(name, human_seconds(row["seconds"]), f"{row['seconds'] / step:.1%}" if step else "-",
                      human_count(row["flops"]) if row["flops"] else "-", human_bytes(row["bytes"]),
                      f"{row['intensity_flops_per_byte']:.1f}" if row["flops"] else "-",
                      human_count(row["achieved_flops_per_second"]) if row["flops"] else "-",
                      human_seconds(row["launch_s"]) if row["launch_s"] else "-", row["bound"])
    table.add_row("step (roofline)", human_seconds(step), "", "", "", "", "", "", "", style="bold")
    table.add_row("throughput (roofline)", f"{r['tokens_per_second']:,.0f} tokens/s", "", "", "", "", "", "", "",
                  style="bold")
    table.caption = f"time = max(FLOPs / rate at the op's shape, bytes / bandwidth) + launches; overlap: {r['overlap']}"
    return table


def plot_roofline(plan: dict, path, name: str = "", measured: dict | None = None) -> None:
    """Log-log arithmetic intensity (FLOP/byte) against FLOP/s: the roof min(peak, intensity x
    bandwidth) at the best measured matmul rate, and each predicted class as a point; `measured`
    ({class: seconds}, from bench/step_time.py's profile) adds the measured points beside them."""
    from lmforge.accounting.plan.chart import pyplot, save
    from lmforge.accounting.roofline import rate_dtype

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
