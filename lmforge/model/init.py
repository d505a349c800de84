"""Parameter initialisation, explicit so that its statistics can be tested. `model.init` picks the
scheme of the linear weights; every scheme shares the rest.

scaled_normal (the default), per tensor:
  * every linear weight W (out x in):  N(0, 1/in)
      "fan-in" scaling (LeCun et al. 1998): each output of x W^T keeps the variance of the inputs,
      so activations neither grow nor shrink through a layer at initialisation;
  * the projections that write into the residual stream (attention o_proj, MLP down_proj):
      N(0, 1/in) further divided by sqrt(2 * n_layers) in standard deviation
      (GPT-2, Radford et al. 2019, section 2.3): the stream sums 2 * n_layers such outputs, so its
      variance stays O(1) with depth instead of growing linearly;
xavier (Glorot & Bengio 2010, eq. 12, its normal form, torch.nn.init.xavier_normal_):
  * every linear weight N(0, 2 / (in + out)): the compromise between keeping the forward variance
      (1/in) and the backward one (1/out); no depth scaling;
kaiming (He et al. 2015, eq. 10, fan_in, torch.nn.init.kaiming_normal_):
  * the linear layer whose output goes into the MLP's nonlinearity (SwiGLU's gate, the GELU and
      ReLU^2 MLPs' up projection: each MLP class names it, ACTIVATION_INPUT) N(0, 2/in), the gain
      sqrt(2) of a ReLU, which zeroes half its input's variance; exact for ReLU, the usual stand-in
      for SiLU and GELU (ReLU-like away from 0); the other linear weights N(0, 1/in) (gain 1:
      they feed no nonlinearity); no depth scaling.
Shared by every scheme:
  * token and position embeddings: N(0, 1/d_model) (a lookup, not a layer: no fan-in to keep).
      With tied embeddings this is also the LM head (untied, the head is a linear of the scheme;
      scaled_normal gives it the same N(0, 1/d_model)), and a unit-RMS final hidden state then
      gives logits of unit variance. The initial loss is therefore ln(vocab_size) + 1/2, not
      ln(vocab_size): E[logsumexp] of V logits iid N(0, s^2) is ln V + s^2/2 (for large V),
      half a nat above a uniform guess (tests/test_model.py checks it to 0.01 nats);
  * model.zero_init_proj=true: o_proj and down_proj start at zero, and so does an untied LM head
      (modded-nanogpt's recipe): every block starts as the identity (the residual stream is the
      embedding) and the zero head gives every token logit 0, a first loss of exactly ln(vocab_size);
  * biases: 0; normalisation layers keep the gain 1 and bias 0 they are built with.
"""

import math

import torch.nn as nn

RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")


def expected_std(name: str, shape: tuple[int, ...], n_layers: int) -> float:
    """Standard deviation the scaled_normal scheme gives the parameter `name` of `shape` (0 for biases)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return 0.0
    if "embeddings" in name:
        return 1.0 / math.sqrt(shape[1])
    std = 1.0 / math.sqrt(shape[1])  # weight is (out, in)
    if any(f"{proj}." in name for proj in RESIDUAL_PROJECTIONS):
        std /= math.sqrt(2 * n_layers)
    return std


def _init_linear(module_name: str, weight, cfg, activated: set[str]) -> None:
    # model.zero_init_proj starts the residual projections and the LM head at zero (the module docstring)
    if cfg.zero_init_proj and (module_name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS or module_name == "lm_head"):
        nn.init.zeros_(weight)
    elif cfg.init == "xavier":
        nn.init.xavier_normal_(weight)
    elif cfg.init == "kaiming":
        nn.init.kaiming_normal_(weight, mode="fan_in", nonlinearity="relu" if module_name in activated else "linear")
    else:
        nn.init.normal_(weight, mean=0.0, std=expected_std(f"{module_name}.weight", tuple(weight.shape), cfg.n_layers))


def init_weights(model: nn.Module, cfg) -> None:
    """Initialise every linear and embedding weight of `model` in place (see the module docstring)."""
    # the linear layers that feed a nonlinearity (kaiming's gain), as each MLP class names them
    activated = {f"{name}.{module.ACTIVATION_INPUT}" for name, module in model.named_modules()
                 if hasattr(module, "ACTIVATION_INPUT")}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=1.0 / math.sqrt(module.weight.shape[1]))
        elif isinstance(module, nn.Linear):
            if module_name == "lm_head" and cfg.tie_embeddings:
                continue  # shared with the token embeddings, initialised there
            _init_linear(module_name, module.weight, cfg, activated)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
