"""The model's shapes, read from the model itself: its parameter count and the weight of every
linear layer, from which this module counts matmul FLOPs (its second half) and memory.py the bytes
of weight casts.

The model is built on the meta device: tensors with shapes and no storage, so building even a 70B
model allocates nothing and takes milliseconds; no formula here repeats what model/transformer.py
builds, so a change to the model changes the accounting with it. A plan asks several times for
the same config, so each config's shapes are read once (a cache keyed by its values).

torch is imported when shapes are first asked for, not with this module: `lmforge runs` and
config-only callers import accounting without loading torch until a number is needed.

Matmul FLOPs of the lmforge transformer, counted from those shapes (the second half of this module).

A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs (one multiply and one add per term), so a
linear layer costs 2 FLOPs per weight per token: this module adds them up over the model's own linear
layers, and counts only the attention matmuls, which have no weights, by formula. Per token, in
the forward pass, that comes to (d model width, h query heads, g key/value heads, q head dim,
f MLP width, T sequence length, V vocabulary):
    QKV projections         2*d*(h*q) for Q, 2*d*(g*q) each for K and V
    output projection       2*(h*q)*d
    attention scores QK^T   2*T*(h*q)
    attention-weighted AV   2*T*(h*q)
    MLP                     2*d*f per matrix: 3 matrices for SwiGLU, 2 for the GELU MLP
    LM head                 2*d*V
Backward costs twice the forward (one matmul for the input gradient, one for the weight
gradient; Kaplan et al. 2020, section 2.1), so training costs 3x the forward.

Causal masking. By default attention is counted over the full T x T score matrix even though
causal masking leaves half of it unused, as PaLM's MFU does (Chowdhery et al. 2022, appendix B:
6N + 12*L*H*Q*T per token), so that MFU is comparable with published numbers. `causal=True`
halves the two attention matmuls instead: the work a kernel that skips masked blocks really
does (FlashAttention, Dao 2023). Elementwise work (norms, softmax, RoPE, activations) is not
counted: it is not matmul work and is small beside it.
"""

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from types import MappingProxyType

from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes import BACKENDS, get_recompute, shard_unit

# The FLOP component of each linear layer, by its name inside a block ("lm_head" outside them).
# A linear layer not named here is refused: a new layer must be given its component on purpose.
COMPONENTS = {
    "attn.q_proj": "qkv_projections", "attn.k_proj": "qkv_projections", "attn.v_proj": "qkv_projections",
    "attn.o_proj": "output_projection",
    "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "mlp",
    "lm_head": "lm_head",
}


@dataclass(frozen=True)
class Shapes:
    parameters: int  # every parameter, a tied one once
    # in_features * out_features of each linear layer, by its name inside a block (summed over
    # the blocks) or outside them ("lm_head"): a token costs 2 FLOPs per weight in forward.
    linear_weights: MappingProxyType
    parameter_shapes: tuple = ()  # the shape of every parameter, a tied one once (memory.py's optimizer states)
    # parameters per ZeRO unit ("rest", "blocks.0", ...), a tied one once (comm.py)
    unit_sizes: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    # beside parameter_shapes: the dimension tensor parallelism splits each along, None if whole
    tp_dims: tuple = ()
    parameter_units: tuple = ()  # beside parameter_shapes: each one's ZeRO unit
    # beside parameter_shapes: the most slices tensor parallelism cuts each into (a k or v
    # projection's: its KV heads; more ranks hold copies), None where tp slices it tp ways
    tp_slices: tuple = ()

    def tensor_rank_shapes(self, tp: int) -> tuple:
        """The shapes one of tp tensor ranks holds (parallel/tp.py): split dimensions divided by
        tp, a k or v projection's by its KV heads where tp is a multiple of them (a replicated KV
        head: one head's rows on each of tp / n_kv_heads ranks)."""
        slices = self.tp_slices or (None,) * len(self.parameter_shapes)
        return tuple(shape if dim is None else (*shape[:dim], shape[dim] // min(tp, cap or tp), *shape[dim + 1:])
                     for shape, dim, cap in zip(self.parameter_shapes, self.tp_dims, slices))

    def tensor_rank_block_matmul_weights(self, tp: int, kv_heads: int) -> int:
        """block_matmul_weights on one of tp tensor ranks: every block linear is split tp ways, k and
        v by their KV heads where tp is a multiple of them (as tensor_rank_shapes)."""
        return sum(w // (min(tp, kv_heads) if name in ("attn.k_proj", "attn.v_proj") else tp)
                   for name, w in self.linear_weights.items() if name != "lm_head")

    def tensor_rank_unit_sizes(self, tp: int) -> dict[str, int]:
        """unit_sizes on one of tp tensor ranks."""
        if tp == 1:
            return dict(self.unit_sizes)
        units: dict[str, int] = {}
        for unit, shape in zip(self.parameter_units, self.tensor_rank_shapes(tp)):
            units[unit] = units.get(unit, 0) + math.prod(shape)
        return units

    @property
    def matmul_weights(self) -> int:
        """Weights that multiply activations, LM head included (tied or not): the N of 6N."""
        return sum(self.linear_weights.values())

    @property
    def block_matmul_weights(self) -> int:
        return self.matmul_weights - self.linear_weights["lm_head"]

    def components(self) -> dict[str, int]:
        """Matmul weights by FLOP component (flops.forward_flops_breakdown's names)."""
        totals: dict[str, int] = {}
        for name, weights in self.linear_weights.items():
            totals[COMPONENTS[name]] = totals.get(COMPONENTS[name], 0) + weights
        return totals


def model_shapes(cfg: ModelConfig) -> Shapes:
    """The shapes of lmforge's Transformer for `cfg`, read from it built on the meta device."""
    # the cache key: the config's values as JSON text (hashable, where a rope_scaling dict is not)
    return _shapes(json.dumps(dataclasses.asdict(cfg), sort_keys=True))


# What parallel/tp.py splits, by a parameter's name inside a block (or outside them) -> dimension:
# column-parallel layers by output features (dim 0, biases too), row-parallel ones by input
# features (dim 1; their biases stay whole), the embedding and LM head by vocabulary rows. The rest
# (norm gains, row-parallel biases, the position table) is whole on every tensor rank.
TP_SPLIT = {f"{layer}.{kind}": 0 for layer in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                                               "mlp.up_proj") for kind in ("weight", "bias")}
TP_SPLIT.update({"attn.o_proj.weight": 1, "mlp.down_proj.weight": 1, "tok_embeddings.weight": 0, "lm_head.weight": 0})


# Split by KV heads: with tp a multiple of them, each slice (one KV head's rows) is on tp / n_kv_heads ranks
KV_SPLIT = {f"attn.{layer}.{kind}" for layer in ("k_proj", "v_proj") for kind in ("weight", "bias")}


def _in_block(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits the parameter `name` along; None where it stays whole."""
    return TP_SPLIT.get(_in_block(name))


def tensor_parallel_slices(name: str, cfg: ModelConfig, tp: int) -> int:
    """How many distinct slices tp ranks hold of the split parameter `name`: tp, but a k or v
    projection's n_kv_heads where tp is a larger multiple of them (parallel/tp.py's `copies`)."""
    return min(tp, cfg.kv_heads) if _in_block(name) in KV_SPLIT else tp


def tensor_rank_shape(name: str, shape: tuple, cfg: ModelConfig, tp: int) -> tuple:
    """The shape one of tp tensor ranks holds of the parameter `name` (as named_parameters names it,
    a LoRA layer's base weight under `.base.`): its split dimension divided by its slices
    (parallel/tp.py), a LoRA adapter's as parallel/tp_lora.py splits it (a column-parallel layer's
    B by its output rows, a row-parallel layer's A by its input columns; the other one whole)."""
    name = name.replace(".base.", ".")
    layer, leaf = name.rsplit(".", 1)
    if leaf in ("lora_A", "lora_B"):
        weight = f"{layer}.weight"
        dim = {(0, "lora_B"): 0, (1, "lora_A"): 1}.get((tensor_parallel_dim(weight), leaf))
    else:
        weight, dim = name, tensor_parallel_dim(name)
    if tp == 1 or dim is None:
        return tuple(shape)
    return (*shape[:dim], shape[dim] // tensor_parallel_slices(weight, cfg, tp), *shape[dim + 1:])


def tensor_parallel_degrees(cfg: ModelConfig, replicate_kv_heads: bool = True) -> list[int]:
    """The tensor-parallel degrees that split attention by whole heads (Shoeybi et al. 2019,
    section 3): those that divide the query heads and divide the KV heads, or are a multiple of
    them (each KV head then held by tp / n_kv_heads ranks, as Megatron-LM replicates them:
    parallel/tp.py). `replicate_kv_heads=False`: only those that divide the KV heads (the
    inference plan splits its KV cache tp ways)."""
    return [tp for tp in range(1, cfg.n_heads + 1) if cfg.n_heads % tp == 0
            and (cfg.kv_heads % tp == 0 or (replicate_kv_heads and tp % cfg.kv_heads == 0))]


def tensor_rank_model(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model whose even split over tp ranks gives each rank the heads parallel/tp.py gives it:
    `cfg`, or with fewer KV heads than ranks `cfg` with tp KV heads (each rank's copy of its KV
    head counted as its own). Attention's saved activations are counted on it (activations.py)."""
    return cfg if tp <= cfg.kv_heads else dataclasses.replace(cfg, n_kv_heads=tp)


@functools.lru_cache(maxsize=64)
def _shapes(values: str) -> Shapes:
    import torch.nn as nn

    from lmforge.model.transformer import meta_model

    model = meta_model(ModelConfig(**json.loads(values)))
    linear_weights: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            # "blocks.7.mlp.up_proj" -> "mlp.up_proj": the same layer of every block, summed
            key = name.split(".", 2)[2] if name.startswith("blocks.") else name
            if key not in COMPONENTS:
                raise ValueError(f"accounting/shapes.py has no FLOP component for the linear layer {name}: "
                                 f"add {key!r} to COMPONENTS")
            linear_weights[key] = linear_weights.get(key, 0) + module.weight.numel()
    units: dict[str, int] = {}
    named = list(model.named_parameters())  # a tied one once, in model.parameters()'s order
    for name, p in named:
        units[shard_unit(name)] = units.get(shard_unit(name), 0) + p.numel()
    return Shapes(parameters=model.num_params(), linear_weights=MappingProxyType(linear_weights),
                  parameter_shapes=tuple(tuple(p.shape) for _, p in named),
                  unit_sizes=MappingProxyType(units), tp_dims=tuple(tensor_parallel_dim(n) for n, _ in named),
                  parameter_units=tuple(shard_unit(n) for n, _ in named),
                  tp_slices=tuple(model.cfg.kv_heads if _in_block(n) in KV_SPLIT else None for n, _ in named))


# -- matmul FLOPs -------------------------------------------------------------------------------
def forward_flops_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs per token, by component, summed over layers: 2 per weight of each
    linear layer, read from the model (shapes.py); the attention matmuls from their formula."""
    weights = model_shapes(cfg).components()
    attention = cfg.n_layers * 2 * seq_len * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)
    return {
        "qkv_projections": 2 * weights["qkv_projections"],
        "output_projection": 2 * weights["output_projection"],
        "attention_scores_qk": attention,
        "attention_values_av": attention,
        "mlp": 2 * weights["mlp"],
        "lm_head": 2 * weights["lm_head"],
    }


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    return sum(forward_flops_breakdown(cfg, seq_len, causal).values())


def training_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False,
                             lora: tuple[int, str] | None = None) -> float:
    """Forward + backward matmul FLOPs per trained token: the model FLOPs of MFU. `lora` = (rank,
    targets): adapters on a frozen base (model/lora.py), counted by lora.py's lora_training_flops_per_token."""
    if lora is not None:
        from lmforge.accounting.lora import lora_training_flops_per_token  # lora.py reads shapes: not at import

        return lora_training_flops_per_token(cfg, seq_len, *lora, causal=causal)
    return 3 * forward_flops_per_token(cfg, seq_len, causal)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                             lora: tuple[int, str] | None = None) -> float:
    """FLOPs the hardware executes per token, counting recomputation (the numerator of HFU,
    Chowdhery et al. 2022, appendix B). Full recomputation runs each block's forward twice, except
    its last matmul: torch.utils.checkpoint stops recomputing once every tensor backward needs is
    back, and the MLP's down projection output is needed by no one. Selective recomputation
    (Korthikanti et al. 2022, section 4.2) reruns the attention core: QK^T and AV where it is one
    fused op (sdpa, flash_*), QK^T alone with `naive`, whose AV output backward does not need.
    With `lora` the training FLOPs are LoRA's; the recomputed forward is still the base's alone."""
    parts, mode = forward_flops_breakdown(cfg, seq_len), get_recompute(recompute)
    extra = 0.0
    if mode.blocks:
        down_projection = 2 * model_shapes(cfg).linear_weights["mlp.down_proj"]
        extra = sum(v for k, v in parts.items() if k != "lm_head") - down_projection
    elif mode.attention_cores:
        fused = lookup(BACKENDS, cfg.attention, "attention backend").fused
        extra = parts["attention_scores_qk"] + (parts["attention_values_av"] if fused else 0)
    return training_flops_per_token(cfg, seq_len, lora=lora) + extra


def six_n_flops_per_token(cfg: ModelConfig) -> float:
    """The 6N approximation (Kaplan et al. 2020, eq. 2.1), attention over the context ignored, with
    N the weights that multiply activations (shapes.Shapes.matmul_weights: the LM head in,
    embedding lookups, norm gains and biases out: they do no matmul work)."""
    return 6 * model_shapes(cfg).matmul_weights


def palm_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B): 6N plus the attention matmuls."""
    return six_n_flops_per_token(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
