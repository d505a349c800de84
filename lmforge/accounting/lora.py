"""What LoRA (model/lora.py) costs beside full training: the adapters' trainable parameters (for
memory: memory.model_state_bytes's `lora_trainable`) and the FLOPs of a step on a frozen base
(shapes.training_flops_per_token with `lora`). Both read the meta-device model with the adapters
applied, so a change to model/lora.py changes the accounting with it."""

import math

from lmforge.accounting.shapes import tensor_rank_shape
from lmforge.config import ModelConfig


def lora_parameters(cfg: ModelConfig, rank: int, targets: str, tp: int = 1) -> int:
    """Trainable parameters of LoRA (model/lora.py): r * (in + out) per targeted linear layer, read
    from the meta-device model with the adapters applied. With tp > 1, those one tensor rank holds
    (parallel/tp_lora.py): a column-parallel layer's B is split by its output rows and its A whole,
    a row-parallel layer's A is split by its input columns and its B whole (shapes.tensor_rank_shape)."""
    from lmforge.model.transformer import meta_model
    from lmforge.model.lora import apply_lora

    return sum(math.prod(tensor_rank_shape(name, tuple(param.shape), cfg, tp))
               for name, param in apply_lora(meta_model(cfg), targets, rank).named_parameters() if param.requires_grad)


def lora_savings(cfg: ModelConfig, rank: int, targets: str, full: dict, held: dict, n_params: int) -> dict:
    """plan["lora"]: what LoRA saves against training every weight (`full`: those model states; `held`:
    LoRA's): gradients, master copies and moments of the frozen base. Activations stay in the plan as
    for full fine-tuning: the gradient of an early adapter flows back through every later layer, which
    therefore keeps its inputs."""
    adapters = lora_parameters(cfg, rank, targets)
    return {"rank": rank, "targets": targets, "trainable_parameters": adapters,
            "trainable_fraction": adapters / n_params,
            "full_finetune_state_bytes": full,
            "saved_bytes": {key: full[key] - held[key] for key in full}}



def lora_training_flops_per_token(cfg: ModelConfig, seq_len: int, rank: int, targets: str,
                                  causal: bool = False) -> float:
    """Forward + backward matmul FLOPs per token of LoRA on a frozen base (model/lora.py).

    Forward: every linear layer, and per adapted one x A^T then (.) B^T, 2*r*(in + out). Backward
    runs only what autograd needs: a layer's input gradient (2 per weight, as the forward) where
    its input depends on something trainable, which the frozen embedding's output does not (so
    the first block's early layers skip theirs), and weight gradients only for the adapters
    (dB, and du = g B to reach A: 2*r*out each; dA: 2*r*in; dx through the adapter: 2*r*in where
    needed). The attention core's backward likewise computes dQ, dK, dP, dV only for what needs
    them. Checked against FlopCounterMode in tests/test_flops.py."""
    import torch.nn as nn

    from lmforge.model.lora import BASE, apply_lora, canonical, lora_layers
    from lmforge.model.transformer import meta_model

    model = apply_lora(meta_model(cfg), targets, rank)
    adapted = set(lora_layers(model))
    # the linear layers by canonical name (an adapted one under its own name, not its base's)
    linears = {canonical(name).removesuffix(f".{BASE}"): module.weight.shape for name, module in model.named_modules()
               if isinstance(module, nn.Linear)}
    attention = 2 * seq_len * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)  # QK^T or AV, per token
    total = 0.0

    def linear(name: str, input_needs_grad: bool) -> bool:
        """Add one linear layer's FLOPs; whether its output needs a gradient."""
        nonlocal total
        out_features, in_features = linears[name]
        total += 2 * in_features * out_features * (1 + input_needs_grad)
        if name in adapted:
            total += 2 * rank * (in_features + out_features) + 2 * rank * (2 * out_features + in_features)
            total += 2 * rank * in_features * input_needs_grad
        return input_needs_grad or name in adapted

    residual = False  # the frozen embedding's output needs no gradient
    for block in model.blocks:
        prefix = f"blocks.{block}."
        layers = [name for name in linears if name.startswith(prefix)]
        q, k, v = (linear(f"{prefix}attn.{n}", residual) for n in ("q_proj", "k_proj", "v_proj"))
        total += 2 * attention + attention * (q + k) + attention * ((q or k) + v)  # forward; dQ dK; dP dV
        residual = linear(f"{prefix}attn.o_proj", q or k or v) or residual
        hidden = any([linear(name, residual) for name in layers  # every MLP layer reading the normalised input
                      if name.startswith(f"{prefix}mlp.") and name != f"{prefix}mlp.down_proj"])
        residual = linear(f"{prefix}mlp.down_proj", hidden) or residual
    linear("lm_head", residual)
    return total
