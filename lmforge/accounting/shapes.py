"""The model's shapes, read from the model itself: its parameter count and the weight of every
linear layer, from which flops.py counts matmul FLOPs and memory.py the bytes of weight casts.

The model is built on the meta device: tensors with shapes and no storage, so building even a 70B
model allocates nothing and takes milliseconds; no formula here repeats what model/transformer.py
builds, so a change to the model changes the accounting with it. A plan asks several times for
the same config, so each config's shapes are read once (a cache keyed by its values).

torch is imported when shapes are first asked for, not with this module: `lmforge runs` and
config-only callers import accounting without loading torch until a number is needed.
"""

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from types import MappingProxyType

from lmforge.config import ModelConfig
from lmforge.modes import shard_unit

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
    parameter_shapes: tuple = ()  # the shape of every parameter, a tied one once (optimizers.py)
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
