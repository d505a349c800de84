"""An inference plan: weights, KV cache, prefill and decode time, the largest batch that fits, for
one serving setup. The formulas and the reasoning behind them: accounting/inference.py."""

from dataclasses import asdict, dataclass

from lmforge.accounting import memory, shapes
from lmforge.accounting.hardware import DEFAULT_RESERVE_BYTES, check_hardware, hardware_figures
from lmforge.accounting.inference import KV_FORMATS, PREFILL_DTYPE, WEIGHT_FORMATS, decode_step_bytes, weight_bytes
from lmforge.accounting.shapes import model_shapes, tensor_parallel_degrees
from lmforge.common.errors import lookup
from lmforge.config import ModelConfig


@dataclass
class InferenceSetup:
    batch_size: int = 1  # sequences decoded together
    seq_len: int = 2048  # context: the prompt prefilled, and the context each decode step reads
    weights: str = "bf16"  # a key of WEIGHT_FORMATS
    group_size: int = 128  # weights per quantisation scale (int8, int4)
    kv_dtype: str = "bf16"  # a key of KV_FORMATS
    tp: int = 1  # tensor-parallel degree: weights and KV heads split tp ways
    hardware: str = "this"
    mfu: float = 0.5  # utilisation assumed for prefill, which is compute-bound
    reserve_bytes: float = DEFAULT_RESERVE_BYTES

    def validate(self, model: ModelConfig) -> None:
        """ValueError for a name or tp this plan cannot cost (`lmforge plan` checks the numbers as it reads them)."""
        lookup(WEIGHT_FORMATS, self.weights, "weight format")
        lookup(KV_FORMATS, self.kv_dtype, "KV cache format")
        check_hardware(self.hardware)
        if self.tp not in tensor_parallel_degrees(model, replicate_kv_heads=False):  # its KV cache split tp ways
            raise ValueError(f"tp {self.tp} must divide the {model.n_heads} attention heads and {model.kv_heads} "
                             f"KV heads (each rank holds whole heads)")


def make_inference_plan(cfg: ModelConfig, setup: InferenceSetup,
                        this_machine: tuple[str, float, float, float] | None = None) -> dict:
    """The inference plan as a JSON-ready dict. `this_machine` = (name, peak FLOP/s, memory bytes,
    memory bandwidth bytes/s), needed when setup.hardware is "this" (the caller measures it)."""
    setup.validate(cfg)
    hardware, peak, device_memory, bandwidth = hardware_figures(setup.hardware, PREFILL_DTYPE[setup.weights],
                                                                this_machine)
    plan_memory = _memory(cfg, setup, device_memory)
    return {
        "model": {"family": cfg.family, "parameters": model_shapes(cfg).parameters, "layers": cfg.n_layers,
                  "d_model": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size},
        "setup": {**asdict(setup), "devices": setup.tp},
        "memory": plan_memory,
        "prefill": _prefill(cfg, setup, peak, sum(plan_memory["weights_bytes"].values()) / bandwidth),
        "decode": _decode(cfg, setup, peak, bandwidth),
        "hardware": {"name": hardware, "peak_flops": peak, "memory_bandwidth": bandwidth,
                     "prefill_dtype": PREFILL_DTYPE[setup.weights]},
    }


def _memory(cfg: ModelConfig, setup: InferenceSetup, device_memory: float) -> dict:
    """plan["memory"]: weights and KV cache per device, whether they fit, the largest batch that does."""
    b, s, tp = setup.batch_size, setup.seq_len, setup.tp
    weights = {k: v / tp for k, v in weight_bytes(cfg, setup.weights, setup.group_size).items()}
    kv_per_sequence = memory.kv_cache_bytes(cfg, 1, s, KV_FORMATS[setup.kv_dtype]) / tp
    total = sum(weights.values()) + b * kv_per_sequence
    room = device_memory - setup.reserve_bytes - sum(weights.values())
    return {
        "weights_bytes": weights,
        "kv_cache_bytes": b * kv_per_sequence,
        "kv_cache_per_sequence_bytes": kv_per_sequence,
        "kv_cache_per_token_bytes": kv_per_sequence / s,
        "per_device_bytes": total,
        "reserve_bytes": setup.reserve_bytes,
        "device_memory_bytes": device_memory,
        "fits": total + setup.reserve_bytes <= device_memory,
        "largest_batch": max(0, int(room // kv_per_sequence)),
    }


def _prefill(cfg: ModelConfig, setup: InferenceSetup, peak: float, weight_seconds: float) -> dict:
    """plan["prefill"]: the prompt's forward FLOPs at the assumed MFU, or reading the weights once
    (`weight_seconds`) if that takes longer."""
    b, s = setup.batch_size, setup.seq_len
    prefill_flops = b * s * shapes.forward_flops_per_token(cfg, s, causal=True)
    compute_seconds = prefill_flops / (setup.tp * peak * setup.mfu)
    seconds = max(compute_seconds, weight_seconds)
    return {"flops": prefill_flops, "seconds": seconds,
            "bound": "compute" if compute_seconds >= weight_seconds else "memory",
            "tokens_per_second": b * s / seconds}


def _decode(cfg: ModelConfig, setup: InferenceSetup, peak: float, bandwidth: float) -> dict:
    """plan["decode"]: one new token per sequence, attending to all s positions before it; the
    step takes the longer of reading its bytes and doing its FLOPs (the roofline)."""
    b, s, tp = setup.batch_size, setup.seq_len, setup.tp
    step_flops = b * shapes.forward_flops_per_token(cfg, s)
    step_bytes = decode_step_bytes(cfg, b, s, setup.weights, setup.group_size, setup.kv_dtype, tp)
    memory_seconds, compute_seconds = step_bytes / bandwidth, step_flops / (tp * peak)
    step_seconds = max(memory_seconds, compute_seconds)
    return {
        "bytes_per_step": step_bytes,
        "flops_per_step": step_flops,
        "seconds_per_step": step_seconds,
        "bound": "memory bandwidth" if memory_seconds >= compute_seconds else "compute",
        "tokens_per_second": b / step_seconds,
        "tokens_per_second_per_device": b / step_seconds / tp,
    }
