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
from lmforge.modes.parallel import shard_unit

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

    def tensor_rank_shapes(self, tp: int) -> tuple:
        """The shapes one of tp tensor ranks holds (parallel/tp.py): split dimensions divided by tp."""
        return tuple(shape if dim is None else (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])
                     for shape, dim in zip(self.parameter_shapes, self.tp_dims))

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


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits the parameter `name` along; None where it stays whole."""
    return TP_SPLIT.get(name.split(".", 2)[2] if name.startswith("blocks.") else name)


def tensor_parallel_degrees(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel degrees that split attention by whole heads: those that divide the
    query and the KV heads alike (Shoeybi et al. 2019, section 3)."""
    return [tp for tp in range(1, cfg.kv_heads + 1) if cfg.n_heads % tp == 0 and cfg.kv_heads % tp == 0]


def meta_model(cfg: ModelConfig, device: str = "meta"):
    """lmforge's Transformer for `cfg` without initialisation: on the meta device shapes and no
    storage; on a real device uninitialised storage, for weights to be assigned (runs/load.py)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from lmforge.model.transformer import Transformer

    random_fills = {torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
                    torch.Tensor.normal_, torch.Tensor.uniform_}

    class SkipRandomFills(TorchFunctionMode):
        """Meta tensors (all this builds) hold no values, so random initialisation has nothing to
        do; and the meta kernel of normal_ is a Python reference that imports torch._dynamo on
        first use: 2-3 s on a busy 2-core machine, 30x the build itself."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in random_fills:
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    with torch.device(device), SkipRandomFills():
        return Transformer(cfg)


@functools.lru_cache(maxsize=64)
def _shapes(values: str) -> Shapes:
    import torch.nn as nn

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
                  parameter_units=tuple(shard_unit(n) for n, _ in named))
