"""What serving costs, by formula: weights, KV cache, the bytes a decode step reads (the plan that
puts them together, with prefill and decode time and the largest batch that fits: plan/inference.py).

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

from lmforge.accounting import memory
from lmforge.accounting.shapes import model_shapes
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup

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
