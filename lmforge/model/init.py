"""Parameter initialisation, explicit so that its statistics can be tested.

The scheme, per tensor:
  * every linear weight W (out x in):  N(0, 1/in)
      "fan-in" scaling (LeCun et al. 1998): each output of x W^T keeps the variance of the inputs,
      so activations neither grow nor shrink through a layer at initialisation;
  * the projections that write into the residual stream (attention o_proj, MLP down_proj):
      N(0, 1/in) further divided by sqrt(2 * n_layers) in standard deviation
      (GPT-2, Radford et al. 2019, section 2.3): the stream sums 2 * n_layers such outputs, so its
      variance stays O(1) with depth instead of growing linearly;
  * token and position embeddings: N(0, 1/d_model); with tied embeddings this is also the LM head
      (untied, the head is a linear with the same N(0, 1/d_model)), and a unit-RMS final hidden
      state then gives logits of unit variance. The initial loss is therefore ln(vocab_size) + 1/2,
      not ln(vocab_size): E[logsumexp] of V logits iid N(0, s^2) is ln V + s^2/2 (for large V),
      half a nat above a uniform guess (tests/test_model.py checks it to 0.01 nats);
  * biases: 0; normalisation layers keep the gain 1 and bias 0 they are built with.
"""

import math

import torch.nn as nn

RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")


def expected_std(name: str, shape: tuple[int, ...], n_layers: int) -> float:
    """Standard deviation this scheme gives the parameter `name` of `shape` (0 for biases)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return 0.0
    if "embeddings" in name:
        return 1.0 / math.sqrt(shape[1])
    std = 1.0 / math.sqrt(shape[1])  # weight is (out, in)
    if any(f"{proj}." in name for proj in RESIDUAL_PROJECTIONS):
        std /= math.sqrt(2 * n_layers)
    return std


def init_weights(model: nn.Module, cfg) -> None:
    """Initialise every linear and embedding weight of `model` in place (see the module docstring)."""
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if isinstance(module, nn.Linear) and module_name == "lm_head" and cfg.tie_embeddings:
                continue  # shared with the token embeddings, initialised there
            name = f"{module_name}.weight"
            nn.init.normal_(module.weight, mean=0.0, std=expected_std(name, tuple(module.weight.shape), cfg.n_layers))
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
