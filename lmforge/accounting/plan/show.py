"""Showing a training plan (plan/make.py) in the terminal: what it is, its memory per device (and
each pipeline stage's), its time, its step by the roofline where predicted (accounting/roofline/:
one row per operation class with its time, share, FLOPs, bytes, arithmetic intensity, achieved
FLOP/s and the bound it hits), and the pieces every plan's tables share (facts_table,
memory_table). An inference plan's tables, the --compare table and the trainer's
predicted-vs-measured table: tables.py; the bar charts: chart.py."""

from rich import box
from rich.console import Console
from rich.table import Table

from lmforge.accounting.dtypes import dtype_table
from lmforge.common.errors import human_bytes, human_count, human_seconds
from lmforge.modes import get_strategy


def print_plan(console: Console, plan: dict, title: str = "lmforge plan") -> None:
    """The plan's tables, training or inference (a plan with "decode" is one)."""
    if "decode" in plan:
        from lmforge.accounting.plan.tables import print_inference_plan  # which imports this module

        print_inference_plan(console, plan, title)
        return
    piped = plan.get("pipeline")
    console.print(head_table(plan, title))
    mem = plan["memory"]
    memory_title = (f"memory per device: pipeline stage {piped['largest_stage']}, the largest" if piped
                    else "memory per device")
    table = memory_table(memory_title, labelled_parts(mem["breakdown_bytes"]), mem, plan["time"]["hardware"])
    table.add_row("activations, Korthikanti et al. 16-bit", human_bytes(mem["activations_korthikanti_bytes"]),
                  f"{mem['activations_to_16bit_parameters_ratio']:.1f}x 16-bit params", style="dim")
    table.add_row("KV cache for inference at this batch x seq", human_bytes(mem["kv_cache_inference_bytes"]), "",
                  style="dim")
    console.print(table)
    if piped:
        print_stages(console, piped)
    console.print(time_table(plan))
    if "scaling" in plan:  # `--scaling FIT.json` or train.scaling_fit (accounting/scaling.py)
        console.print(scaling_line(plan["scaling"]))
    if "roofline" in plan:
        wide(console, 130).print(roofline_table(plan))


def wide(console: Console, width: int) -> Console:
    """`console` at least `width` columns wide (a table too wide to wrap), as quiet as it is: under
    torchrun the other ranks' consoles print nothing (train/loop.py)."""
    return Console(file=console.file, width=max(console.width, width), quiet=console.quiet)


def scaling_line(s: dict) -> str:
    """The loss the fit predicts for the plan's N and tokens, and for the best split of the same compute."""
    return (f"predicted final loss (scaling fit): {s['loss']:.4f} for N {s['parameters']:,} on {s['tokens']:,.0f} "
            f"tokens; the same compute spent optimally: N {s['compute_optimal_parameters']:,.0f} on "
            f"{s['compute_optimal_tokens']:,.0f} tokens, loss {s['compute_optimal_loss']:.4f}")


def head_table(plan: dict, title: str) -> Table:
    """What the plan is: the model, the setup, its parallelism, tokens, traffic and FLOPs."""
    m, st, f = plan["model"], plan["setup"], plan["flops"]
    piped = plan.get("pipeline")
    parallel = f"dp {st['dp']} x tp {st['tp']} x pp {st['pp']} = {st['devices']} device(s)"
    if st.get("dp_replicate", 1) > 1:  # hybrid sharding: dp split as parallel/mesh.py splits it
        parallel = parallel.replace(f"dp {st['dp']}", f"dp_replicate {st['dp_replicate']} x dp_shard "
                                                      f"{st['dp'] // st['dp_replicate']}", 1)
    steps = (f"{st['micro_batches']} micro-batches" if piped or st["micro_batches"] > 1
             else f"accum {st['grad_accum']}")
    if st["tp"] > 1:
        parallel += ", sequence parallel" if st["sequence_parallel"] else ", no sequence parallelism"
    cp = plan.get("context_parallel")
    if cp:
        parallel = f"dp {st['dp']} x cp {cp['cp']} x tp {st['tp']} = {st['devices']} device(s)"
    head = facts_table(title, [
        ("model", f"{m['family']}: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads "
                  f"({m['kv_heads']} kv), ffn {m['ffn_dim']}, vocab {m['vocab_size']:,}"),
        ("parameters", f"{human_count(m['parameters'])} ({m['parameters']:,})"),
        ("setup", f"batch {st['batch_size']} x seq {st['seq_len']} x {steps}, {st['precision']}, "
                  f"{st['optimizer']}, ZeRO {st['zero_stage']}, recompute {st['recompute']}, {st['attention']}"),
        ("parallelism", parallel),
        ("tokens per step", f"{st['tokens_per_step']:,}"),
        ("sent per step per rank", communication_line(plan["communication"])
         + ("; between stages: see below" if piped else "")),
        *([("sent by tensor ranks", tensor_parallel_line(plan["communication"]["tensor_parallel"]))]
          if "tensor_parallel" in plan["communication"] else []),
        *([("context parallel", f"{cp['tokens_per_rank_per_sequence']:,} of {cp['padded_seq_len']:,} tokens of "
                                f"each row per rank ({cp['chunks']} zig-zag chunks of {cp['chunk_tokens']:,}); ring "
                                f"sends {human_bytes(plan['communication']['context_parallel']['sent_bytes'])} "
                                f"per step per rank; {human_count(cp['training_flops_per_rank_per_step'])} "
                                f"training FLOPs per step per rank")] if cp else []),
        # LoRA: no weight gradients for the frozen base (flops.lora_training_flops_per_token)
        ("training FLOPs per token", f"{human_count(f['training_per_token'])}"
                                     + (" with LoRA (full: " if "lora" in plan else " (PaLM 6N+12LHQT: ")
                                     + f"{human_count(f['palm_per_token'])})"),
        # N is not the parameter count above: say which parameters it leaves out
        ("6N", f"{human_count(f['six_n_per_token'])}, N = {human_count(m['matmul_parameters'])} matmul weights "
               f"(norms, biases, embedding lookups left out)"),
        ("training FLOPs per step", human_count(f["training_per_step"])),
    ])
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
        states = human_bytes(saved["optimizer_states"] + saved["master_weights"])
        head.add_row("saved vs full fine-tuning", f"gradients {human_bytes(saved['gradients'])}, optimizer states "
                                                   f"{states} (activations: the same)")
    return head


def time_table(plan: dict) -> Table:
    """A step's time at the assumed MFU (and a pipeline's bubble), a run's own steps' and the token budget's."""
    st, t, budget = plan["setup"], plan["time"], plan["budget"]
    timing = facts_table(f"time on {t['hardware']} at {t['assumed_mfu']:.0%} MFU", [
        ("peak per device", f"{human_count(t['peak_flops_per_device'])}FLOP/s ({t['matmul_dtype']})"),
        ("time per step", human_seconds(t["seconds_per_step"])),
    ])
    if "pipeline" in plan:
        add_bubble_rows(timing, plan["pipeline"], t["assumed_mfu"])
    timing.add_row("throughput", f"{t['tokens_per_second']:,.0f} tokens/s")
    if "run" in t:  # the run's own steps first: what it takes, before the budget's reference
        run = t["run"]
        timing.add_row(f"time for the run's {run['steps']:,} steps ({human_count(run['tokens'])} tokens)",
                       f"{human_seconds(run['seconds'])} on {st['devices']} device(s)")
    source = "" if t["tokens_source"] == "given" else " (Chinchilla's 20 per parameter: no --tokens)"
    timing.add_row(f"time for {human_count(t['tokens'])} tokens{source}",
                   f"{human_seconds(t['seconds_for_tokens'])} on {st['devices']} device(s)")
    timing.add_row("training FLOPs for them", f"{budget['training_flops']:.3e}")
    timing.add_row("device-hours", f"{budget['device_hours']:,.0f}")
    if budget["cost"] is not None:
        timing.add_row(f"cost at {budget['price_per_device_hour']:g} per device-hour", f"{budget['cost']:,.0f}")
    return timing


def print_stages(console: Console, piped: dict) -> None:
    """plan["pipeline"]'s stages, one row each: what each device of that stage holds."""
    chunks = f", {piped['virtual_stages']} chunks per stage" if piped.get("virtual_stages", 1) > 1 else ""
    table = Table(title=f"pipeline stages ({piped['schedule']}, {piped['micro_batches']} micro-batches{chunks})",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("stage", "layers", "weights", "grads", "optimizer", "activations x in flight", "total",
                   "sent/step"):
        table.add_column(column, justify="right", no_wrap=True)
    for d in piped["stages_detail"]:
        parts = d["breakdown_bytes"]
        layers = ",".join(f"{first}-{last}" if last > first else str(first) for first, last in d["chunk_layers"])
        table.add_row(str(d["stage"]), layers,
                      human_bytes(parts["parameters"]), human_bytes(parts["gradients"]),
                      human_bytes(parts["master_weights"] + parts["optimizer_states"]),
                      f"{human_bytes(d['activations_per_micro_batch_bytes'])} x {_count(d['micro_batches_in_flight'])}",
                      human_bytes(d["total_bytes"]), human_bytes(sum(d["sent_bytes_per_step"].values())),
                      style="bold" if d["stage"] == piped["largest_stage"] else None)
    wide(console, 120).print(table)


def _count(n: float) -> str:
    """Micro-batches: 4, or 5.5 / 2.33 where interleaving makes them fractions."""
    return f"{n:g}" if float(n).is_integer() or n * 2 == int(n * 2) else f"{n:.2f}"


def add_bubble_rows(timing: Table, piped: dict, assumed_mfu: float) -> None:
    """The bubble by its formula, the slowest stage that sets the pace, and the MFU that leaves."""
    p, m, v = piped["stages"], piped["micro_batches"], piped.get("virtual_stages", 1)
    slowest = piped["stages_detail"][piped["slowest_stage"]]
    each = f"{human_seconds(slowest['seconds_per_micro_batch'])} (stage {slowest['stage']})"
    if v == 1:
        step = f"(m + p - 1) x slowest stage = {m + p - 1} x {each}"
        bubble = f"(p - 1) / (m + p - 1) = {p - 1}/{m + p - 1}"
    else:  # interleaved: the fill and drain are p - 1 chunks of 1/v of a stage
        step = f"(m + (p - 1) / v) x slowest stage = {_count(m + (p - 1) / v)} x {each}"
        bubble = f"(p - 1) / (v m + p - 1) = {p - 1}/{v * m + p - 1}"
    timing.add_row("pipeline step", f"{step}; no bubble: {human_seconds(piped['ideal_seconds_per_step'])}")
    timing.add_row("bubble", f"{bubble} = {piped['bubble_fraction']:.1%} of the step idle")
    timing.add_row("MFU at best", f"{piped['best_mfu']:.1%} = {assumed_mfu:.0%} x no bubble / pipeline step: the "
                                  f"bubble and unequal stages cost {assumed_mfu - piped['best_mfu']:.1%}")


def communication_line(c: dict) -> str:
    """accounting/comm.py's count in one line."""
    if not c["sent_bytes"]:
        return "nothing (one data-parallel rank)"
    paper = "3" if get_strategy(c["strategy"]).zero_stage == 3 else "2"  # ZeRO-3 and FSDP gather the weights too
    return (f"{human_bytes(c['sent_bytes'])} ({c['strategy']}: (N-1)/N x {c['ring_elements']:,} elements of "
            f"{c['element_bytes']} bytes, ring; paper {paper}Psi = {human_bytes(c['paper_bytes'])})")


def tensor_parallel_line(c: dict) -> str:
    """accounting/comm.py's tensor_parallel_communication in one line: (tp-1)/tp of its ring bytes."""
    parts = ", ".join(f"{part.replace('_', ' ')} {human_bytes(n)}" for part, n in c["ring_bytes"].items() if n)
    return f"{human_bytes(c['sent_bytes'])} per step ((tp-1)/tp of ring bytes: {parts})"


def print_dtypes(console: Console) -> None:
    table = Table(title="floating-point formats (from torch.finfo)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("dtype", "bits", "bytes", "exp", "mant", "max", "min normal", "eps"):
        table.add_column(column, justify="right" if column != "dtype" else "left", no_wrap=True)
    for d in dtype_table():
        table.add_row(d.name, str(d.bits), str(d.bytes), str(d.exponent_bits), str(d.mantissa_bits),
                      f"{d.max:.4g}".replace("e+", "e"), f"{d.smallest_normal:.3g}", f"{d.eps:.3g}")
    console.print(table)


# What the tables and charts call the parts of a training plan's memory (plan["memory"]["breakdown_bytes"])
MEMORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "optimizer states",
    "weight_copies": "low-precision weight copies",
    "activations": "activations (saved for backward)",
    "logits": "logits + fp32 loss copy",
}


def labelled_parts(breakdown: dict) -> list[tuple[str, float]]:
    """A training plan's non-zero memory parts (plan["memory"]["breakdown_bytes"]), by their labels."""
    return [(MEMORY_LABELS.get(key, key), value) for key, value in breakdown.items() if value]


def facts_table(title: str, rows: list[tuple[str, str]] = ()) -> Table:
    """A two-column table of (what, value) rows, without a header."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def memory_table(title: str, parts: list[tuple[str, float]], mem: dict, hardware: str) -> Table:
    """Memory per device: each non-zero part with its share of the total, the total, then the
    reserve and whether total + reserve fits the device."""
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = mem["per_device_bytes"]
    for label, value in parts:
        if value:
            table.add_row(label, human_bytes(value), f"{value / total:.1%}")
    table.add_row("total", human_bytes(total), "", style="bold")
    reserve = mem["reserve_bytes"]
    table.add_row("reserve (--reserve: CUDA context, fragmentation)", human_bytes(reserve), "", style="dim")
    verdict = "fits" if mem["fits"] else "does NOT fit"
    table.add_row(f"device memory ({hardware}, as the device reports it)", human_bytes(mem["device_memory_bytes"]),
                  f"{verdict} ({(total + reserve) / mem['device_memory_bytes']:.0%})",
                  style="green" if mem["fits"] else "red")
    return table


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
