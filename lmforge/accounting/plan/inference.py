"""What serving costs, by formula: weights, KV cache, the bytes a decode step reads; and the plan that
puts them together for one serving setup, with prefill and decode time and the largest batch that fits.

Serving a model runs two phases (Pope et al. 2022, "Efficiently Scaling Transformer Inference",
section 2; the same split as vLLM's and TensorRT-LLM's sizing guides):

- prefill: the prompt's b*s tokens go through the model at once. Matmuls with b*s rows: compute-
  bound, so its time is forward FLOPs / (peak * utilisation), counted with the causal half of the
  attention matrix (shapes.py, causal=True: a prefill kernel skips the masked blocks).
- decode: one new token per sequence per step. Each step reads every weight once and every cached
  key and value of the b sequences, and does 2 FLOPs per weight per token: far too few FLOPs per
  byte to keep the matmul units busy, so a step takes (weight bytes + KV bytes) / memory bandwidth,
  unless the batch is so large that its FLOPs take longer (the roofline: the larger of the two).

KV cache: keys and values of every layer and KV head, 2*b*s*L*g*d_head*bytes (memory.kv_cache_bytes,
grouped-query attention through g); tensor parallelism splits the KV heads, and everything else,
tp ways. Weights: 16-bit, or int8/int4 for the block linear layers with one fp16 scale per group
of `group_size` weights (symmetric quantisation, as GPTQ and AWQ store it, zero points left out);
embedding, LM head and norms stay 16-bit, as those tools leave them. Activations of a forward pass
are left out: beside the KV cache they are small at decode, and a server prefills in chunks.
"""

from dataclasses import asdict, dataclass

from lmforge.accounting import memory, shapes
from lmforge.accounting.hardware import DEFAULT_RESERVE_BYTES, check_hardware, hardware_figures
from lmforge.accounting.shapes import model_shapes, tensor_parallel_degrees
from lmforge.common.errors import lookup
from lmforge.config import ModelConfig

WEIGHT_FORMATS = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}  # bytes per weight
KV_FORMATS = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# the matmul dtype whose peak prefill runs at (quantised weights are dequantised to 16 bits to multiply)
PREFILL_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "bfloat16", "int4": "bfloat16"}
SCALE_BYTES = 2  # one fp16 scale per group


def unquantised_bytes(weights: str) -> int:
    """Bytes per element of what no format quantises (embedding, LM head, norms): 16-bit unless fp32."""
    return 4 if weights == "fp32" else 2


def weight_bytes(cfg: ModelConfig, weights: str = "bf16", group_size: int = 128) -> dict[str, float]:
    """Bytes of the whole model's weights in `weights` format: the block linear layers (quantised
    ones with their scales) and the rest (embedding, LM head, norms: 16-bit unless fp32)."""
    shapes = model_shapes(cfg)
    per_weight = lookup(WEIGHT_FORMATS, weights, "weight format")
    quantised = weights in ("int8", "int4")
    block = shapes.block_matmul_weights
    return {
        "block_linear": block * per_weight,
        "scales": block / group_size * SCALE_BYTES if quantised else 0.0,
        "embedding_head_norms": (shapes.parameters - block) * unquantised_bytes(weights),
    }


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, weights: str = "bf16", group_size: int = 128,
                      kv_dtype: str = "bf16", tp: int = 1) -> float:
    """Bytes one of tp devices reads per decode step: its share of the weights in `weights` format,
    less the token embedding table (a step gathers `batch` rows of it) unless the LM head shares
    it, and of the KV cache in `kv_dtype` of `batch` sequences at `context` tokens."""
    weight_total = sum(weight_bytes(cfg, weights, group_size).values())
    if not cfg.tie_embeddings:
        weight_total -= cfg.vocab_size * cfg.d_model * unquantised_bytes(weights)
    kv = memory.kv_cache_bytes(cfg, batch, context, KV_FORMATS[kv_dtype])
    return (weight_total + kv) / tp



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
