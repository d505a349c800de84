"""Showing an inference plan (plan/inference.py) in the terminal: what it serves, its memory per
device and the largest batch that fits, prefill and decode time."""

from rich.console import Console
from rich.table import Table

from lmforge.accounting.plan.show import facts_table, memory_table
from lmforge.common.errors import human_bytes, human_count, human_seconds


def print_inference_plan(console: Console, plan: dict, title: str) -> None:
    console.print(head_table(plan, title))
    console.print(inference_memory_table(plan))
    console.print(time_table(plan))


def head_table(plan: dict, title: str) -> Table:
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


def time_table(plan: dict) -> Table:
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
