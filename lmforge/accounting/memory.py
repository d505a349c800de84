"""Memory per device, in bytes, from the config and the model's shapes: model states, the logits,
the KV cache (what is saved for backward: activations.py).

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1): parameters, gradients and optimizer
states. In the paper's mixed-precision Adam a parameter costs 2 + 2 + K bytes (fp16 weight, fp16
gradient, K = 12 bytes of fp32 master weight, momentum and variance); ZeRO stage 1 shards the K
bytes over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 also the weights
(section 5.1-5.3). `zero_paper_model_state_bytes` is that formula; `model_state_bytes` is what
lmforge's own precision policies store (lmforge/precision/), each split the same way.

Optimizer states (`optimizer_state_bytes`), by optimizer: what `lmforge plan --optimizer` chooses.

EleutherAI's "Transformer Math 101" (Anthony, Biderman and Schoelkopf 2023, "Optimizer States")
counts, per parameter in mixed precision, an fp32 copy of the weights (4 bytes) plus the states:
AdamW 4 + 8 = 12 bytes (momentum and variance, fp32), 8-bit AdamW 4 + 2 = 6 (bitsandbytes),
SGD with momentum 4 + 4 = 8. lmforge's mixed-precision policies keep fp32 parameters that are
their own master copy (modes/precision.py), so the states alone are counted here and the copy
is the policy's parameter bytes. The others:

- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", algorithm 2) keeps only
  the momentum: one state, as SGD with momentum.
- Adam keeps AdamW's two; AdaGrad its sum of squared gradients, RMSProp its moving average of them
  (as trained: no momentum, not centered; optim/rmsprop.py): one each.
- Adafactor (Shazeer and Stern 2018, section 3) without momentum (beta1 = 0, the paper's and
  Hugging Face's default) factors the second moment of an n x m matrix into n row and m column
  averages: 4(n + m) bytes instead of 4nm; a vector keeps its full second moment.
- 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", section 2):
  each state in one byte, with one fp32 absolute maximum per block of 2048 values; bitsandbytes
  keeps the states of tensors under 4096 elements (`min_8bit_size`) in fp32.

Factored and 8-bit states depend on each parameter's shape, read from the model (shapes.py).
"""

import math
from dataclasses import dataclass, replace

from lmforge.accounting.shapes import model_shapes
from lmforge.config import ModelConfig
from lmforge.common.errors import lookup
from lmforge.modes import OPTIMIZER_MODES, POLICIES, Policy


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of lmforge's Transformer for cfg (tied embeddings counted once), read from the model."""
    return model_shapes(cfg).parameters


def sharded_layout(policy: Policy, zero_stage: int) -> Policy:
    """`policy` as the sharding engines run it: ZeRO stages 1-3 and FSDP (parallel/zero.py,
    fsdp.py) under a mixed policy compute on 16-bit working weights with fp32 master weights
    (Rajbhandari et al. 2020, section 3.1), so every parameter, the embedding's output and the
    residual stream are 16-bit, and autocast casts no weight for a matmul (an fp8 linear still
    quantises its own, from the gathered weight: whole, under stage 3 too). Measured against the
    engines in tests/test_memory_engines.py. Other policies and zero stage 0 are returned as they are."""
    if zero_stage == 0 or not policy.autocast:
        return policy
    p = policy.bytes
    return replace(policy, bytes=replace(p, parameter=p.compute, gradient=p.compute, master=4, residual=p.compute,
                                         weight_copy=p.weight_copy if policy.fp8 else 0, head_weight_copy=0))


# -- optimizer states ----------------------------------------------------------------------------
QUANTIZATION_BLOCK = 2048  # values per fp32 absmax in 8-bit states (Dettmers et al. 2022)
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 states (bitsandbytes' default)


@dataclass(frozen=True)
class Optimizer:
    states: int  # state tensors of each parameter's shape (Adafactor: 0, its states are factored)
    eight_bit: bool = False  # states quantised to one byte, block-wise
    factored: bool = False  # Adafactor's row and column second moments
    hidden_matrix_states: int | None = None  # Muon: states of a block's 2-D weights (the rest: `states`)


_STATES: dict[str, Optimizer] = {
    "adamw": Optimizer(states=2),
    "adam": Optimizer(states=2),
    "adamw-8bit": Optimizer(states=2, eight_bit=True),
    "adafactor": Optimizer(states=0, factored=True),
    "lion": Optimizer(states=1),
    "sgd-momentum": Optimizer(states=1),
    "sgd": Optimizer(states=0),
    "adagrad": Optimizer(states=1),
    "rmsprop": Optimizer(states=1),
    # Muon's momentum for the blocks' matrices, AdamW's two moments for the rest (optim/muon.py)
    "muon": Optimizer(states=2, hidden_matrix_states=1),
}
# keyed by modes/optimizers.py's names, in its order: a name added there without its states here
# fails at import, not in the middle of a plan
OPTIMIZERS: dict[str, Optimizer] = {name: _STATES[name] for name in OPTIMIZER_MODES}


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str = "adamw", policy: Policy = POLICIES["fp32"],
                          parameter_shapes: tuple | None = None, hidden_matrices: int | None = None) -> float:
    """Bytes of every optimizer state of the whole model (unsharded), or of the parameters of
    `parameter_shapes` (a pipeline stage's: accounting/pipeline.py, with `hidden_matrices`, the
    elements of its blocks' 2-D weights, for Muon); `policy` gives the bytes of a full-precision
    state element (fp32, or bf16 under bf16-pure)."""
    opt = lookup(OPTIMIZERS, optimizer, "optimizer")
    element = policy.bytes.optimizer_state
    if opt.hidden_matrix_states is not None:
        if parameter_shapes is None:
            shapes = model_shapes(cfg)
            # a block's 2-D parameters are its linear layers' weights (optim/muon.py's is_hidden_matrix)
            parameters, hidden_matrices = shapes.parameters, shapes.block_matmul_weights
        elif hidden_matrices is None:  # shapes alone do not say which are the blocks' matrices
            raise ValueError(f"{optimizer}'s states of a pipeline stage need its hidden_matrices "
                             f"(accounting/pipeline.py's StageParameters)")
        else:
            parameters = sum(math.prod(shape) for shape in parameter_shapes)
        return element * (opt.states * parameters - (opt.states - opt.hidden_matrix_states) * hidden_matrices)
    total = 0.0
    for shape in parameter_shapes if parameter_shapes is not None else model_shapes(cfg).parameter_shapes:
        n = math.prod(shape)
        if opt.factored:
            # Hugging Face's layout: row averages over the last dim, column averages over the second to last
            total += element * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else n)
        elif opt.eight_bit and n >= MIN_8BIT_SIZE:
            total += opt.states * (n + 4 * math.ceil(n / QUANTIZATION_BLOCK))
        else:
            total += opt.states * n * element
    return total


# -- model states --------------------------------------------------------------------------------

def zero_paper_model_state_bytes(n_params: int, stage: int, dp: int, k: int = 12) -> float:
    """Rajbhandari et al. 2020, figure 1 and section 5: (2 + 2 + K) * Psi bytes on one device,
    with the K optimizer bytes (stage >= 1), the gradients (>= 2) and the weights (3) split N_d ways."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    weights, grads, optimizer = 2 * n_params, 2 * n_params, k * n_params
    return (weights / (dp if stage >= 3 else 1) + grads / (dp if stage >= 2 else 1)
            + optimizer / (dp if stage >= 1 else 1))


def model_state_bytes(cfg: ModelConfig, policy: Policy = POLICIES["fp32"], optimizer: str = "adamw",
                      zero_stage: int = 0, dp: int = 1, tp: int = 1, lora_trainable: int | None = None,
                      parameter_shapes: tuple | None = None, fully_shard: bool = False,
                      hidden_matrices: int | None = None) -> dict[str, float]:
    """Bytes per device of parameters, gradients, master weights and optimizer states, as the
    engine of the strategy holds them (each engine's `state_bytes`; tests/test_composition_dist.py
    compares them in every cell it trains).

    `parameter_shapes`: the parameters this device holds, default the whole model; a pipeline
    stage's rank holds its own (accounting/pipeline.py's stage_parameters: a tensor rank's slices,
    as given, divided no further). Tensor parallelism (tp) splits the weights themselves: a tensor
    rank holds the shapes parallel/tp.py gives it (shapes.py's tensor_rank_shapes: the split
    matrices divided by tp (k and v by their KV heads where tp is a multiple of them), norm gains
    and row-parallel biases whole), so do its gradients and optimizer states. `lora_trainable`: the
    adapter parameters one device holds (lora_parameters with tp). ZeRO's and FSDP's padding to a
    multiple of dp is not counted. `hidden_matrices`: a stage's Muon elements.

    `fully_shard` (train.parallel=fsdp, zero_stage 3): FSDP2 shards the parameters as the policy
    stores them (fp32 under the mixed policies: they are the master weights) and keeps sharded
    gradients in that dtype too; its 16-bit copies exist only while a block is gathered. ZeRO's
    engines keep 16-bit working parameters and gradients and fp32 master shards (sharded_layout).

    With LoRA (`lora_trainable` adapter parameters) the base is frozen: it is stored in the
    policy's parameter dtype and has no gradient, master copy or optimizer state; ZeRO keeps it
    whole on every rank at every stage (parallel/zero.py), FSDP shards it. The adapters are fp32
    (train/setup.py creates them after the policy), with fp32 moments; ZeRO computes with them in
    its working dtype (16-bit copies and gradients, the fp32 adapters as master shards) where that
    is not fp32, the other engines in fp32.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    if fully_shard and zero_stage != 3:
        raise ValueError(f"fully_shard shards parameters: zero stage 3, got {zero_stage}")
    p = policy.bytes
    layout = (policy if fully_shard else sharded_layout(policy, zero_stage)).bytes
    even = tp if parameter_shapes is None else 1  # what is left to divide evenly
    if tp > 1 and parameter_shapes is None:  # a tensor rank's own shapes: its norm gains whole
        shapes = model_shapes(cfg)
        parameter_shapes, even = shapes.tensor_rank_shapes(tp), 1
        if lookup(OPTIMIZERS, optimizer, "optimizer").hidden_matrix_states is not None:  # Muon: its slices
            hidden_matrices = shapes.tensor_rank_block_matmul_weights(tp, cfg.kv_heads)
    held = parameter_count(cfg) if parameter_shapes is None else sum(math.prod(shape) for shape in parameter_shapes)
    n = held / even
    if lora_trainable is None:
        frozen, trained = 0, n
        parameter, gradient, master = layout.parameter, layout.gradient, layout.master
        optimizer_bytes = optimizer_state_bytes(cfg, optimizer, policy, parameter_shapes, hidden_matrices) / even
    else:
        frozen, trained = n * p.parameter, lora_trainable
        zero = zero_stage > 0 and not fully_shard
        parameter = layout.parameter if zero else 4  # the working adapters: ZeRO's dtype, else fp32
        gradient, master = parameter, 4 if parameter != 4 else 0
        optimizer_bytes = trained * lookup(OPTIMIZERS, optimizer, "optimizer").states * 4
    frozen_split = dp if fully_shard else 1  # ZeRO keeps the frozen base whole
    return {
        "parameters": frozen / frozen_split + trained * parameter / (dp if zero_stage >= 3 else 1),
        "gradients": trained * gradient / (dp if zero_stage >= 2 else 1),
        "master_weights": trained * master / (dp if zero_stage >= 1 else 1),
        "optimizer_states": optimizer_bytes / (dp if zero_stage >= 1 else 1),
    }


def logits_bytes(cfg: ModelConfig, b: int, s: int, policy: Policy = POLICIES["fp32"],
                 loss_chunk_tokens: int = 0) -> float:
    """The LM head's logits and their fp32 copy for the loss: alive at the end of the forward
    pass beside everything saved; for small models with large vocabularies the largest tensor.
    The chunked loss holds those of one chunk of `loss_chunk_tokens` tokens at a time."""
    p = policy.bytes
    tokens = min(loss_chunk_tokens, b * s) if loss_chunk_tokens else b * s
    return tokens * cfg.vocab_size * (p.compute + (4 if p.compute < 4 else 0))


def kv_cache_bytes(cfg: ModelConfig, b: int, s: int, dtype_bytes: int = 2) -> int:
    """Inference KV cache: keys and values for every layer and kv head, 2*b*s*L*g*d_head*bytes."""
    return 2 * b * s * cfg.n_layers * cfg.kv_heads * cfg.head_dim * dtype_bytes
