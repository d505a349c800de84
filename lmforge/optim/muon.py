"""Muon: momentum orthogonalised by Newton-Schulz, for the hidden 2-D weights (Jordan et al. 2024,
"Muon: An optimizer for hidden layers in neural networks", kellerjordan.github.io/posts/muon),
with AdamW (optim/adamw.py) for everything else, in one optimizer.

For a hidden weight matrix W (out x in) with gradient G at each step:

    B <- mu B + (1 - mu) G                      momentum, as an average (torch.optim.Muon's form;
                                                its scale is divided away by the normalisation below)
    U  = (1 - mu) G + mu B   (Nesterov)  or  B
    O  = NS_5(U)                                ~ the orthogonal factor of U: U = P S Q^T -> ~ P Q^T
    W <- W - lr lambda W                        decoupled weight decay (Loshchilov & Hutter 2019)
    W <- W - lr * sqrt(max(1, out / in)) * O    the shape adjustment ("original"); or
          lr * 0.2 sqrt(max(out, in))           ("match_rms_adamw": Liu et al. 2025, "Muon is
                                                Scalable for LLM Training", eq. 4: the update's RMS
                                                that of AdamW, so AdamW's lr and decay carry over)

NS_5 is the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T, five times, from
X = U / ||U||_F (the Frobenius norm bounds the spectral norm, so every singular value starts in
[0, 1]). Each step maps a singular value s to a s + b s^3 + c s^5; Jordan's coefficients
(3.4445, -4.7750, 2.0315) maximise the slope at 0, so that small singular values grow fast, at the
price of not converging to exactly 1 (they end in about [0.7, 1.2]), which does not hurt training.
The iteration runs in bf16, as the reference does: its aim is that rough band, not a precise
factor, and bf16 matmuls are twice the fp32 rate on GPUs. A tall matrix is transposed first, so
that A = X X^T is the smaller Gram matrix.

Which parameters: a 2-D weight inside a block (`blocks.N....`: attention and MLP projections) goes
to Muon. LoRA adapters do not (AdamW): A (r x in) and B (out x r) are factors of the update B A,
not linear maps between hidden states, and orthogonalising each would set all r singular values
of each factor to about 1, whatever the product's scale (B starts at zero: its first orthogonal
step would be a full-size one), with the shape rule's sqrt(out / r) blowing B's rate up further;
Muon's argument (the update of a hidden map, normalised in spectral norm) is about B A, which
neither factor's Newton-Schulz controls. So Muon with LoRA is AdamW on the adapters. The
embeddings and the output head are 2-D but not hidden (a row per token, not a linear map between
hidden states: the post's "Other parameters" rule), and norms and biases are not matrices: AdamW,
with decay on the embeddings and head only, as in train/setup.py.
`muon_param_groups` makes that split by canonical name (model/names.py), in the model's parameter
order, so the groups are the same on every run and a checkpoint resumes by name.

The learning-rate schedule sets one rate in every group (train/loop.py); a Muon group multiplies
it by its `lr_multiplier` (optim.muon_lr / optim.lr), so Muon's peak is optim.muon_lr and both
follow the schedule's shape. The decay uses that multiplied rate, as torch's uses its lr.
"""

import math

import torch
import torch.nn as nn

from lmforge.config.schema import MUON_ADJUST_LR as ADJUST_LR
from lmforge.model.names import canonical_name
from lmforge.optim.adamw import AdamW

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024 (and torch.optim.Muon's defaults)
NS_STEPS = 5
NS_EPS = 1e-7  # keeps the normalisation finite for a zero update


def orthogonalize(update: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """NS_steps(update): the 2-D `update` (or each matrix of a (k, m, n) stack) with its singular
    values pushed to about 1, in bf16."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    fused = torch.baddbmm if x.ndim == 3 else torch.addmm  # beta * input + alpha * (m1 @ m2)
    for _ in range(steps):
        gram = x @ x.mT
        # b A + c A A, then a X + (that) X: one rounding each, in the fused form
        poly = fused(gram, gram, gram, beta=b, alpha=c)
        x = fused(x, poly, x, beta=a)
    return x.mT if tall else x


def orthogonalize_all(updates: list[torch.Tensor], coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                      eps: float = NS_EPS) -> list[torch.Tensor]:
    """orthogonalize(u) for each of `updates`, the matrices of one shape stacked into one batched
    iteration: a block's projections share a few shapes, and one bmm per shape instead of one mm per
    matrix took 0.55-0.8x the time on `small` (36 matrices, 4 shapes: bench/muon_batched.py). A tall
    matrix is transposed into the stack as a copy, so each matrix's arithmetic is the 2-D path's,
    bit for bit (tests/test_muon.py)."""
    by_shape: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault(tuple(u.shape), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(updates)
    for (rows, cols), indices in by_shape.items():
        if len(indices) == 1:
            out[indices[0]] = orthogonalize(updates[indices[0]], coefficients, steps, eps)
            continue
        tall = rows > cols
        stack = torch.stack([updates[i].bfloat16().T if tall else updates[i].bfloat16() for i in indices])
        stack = orthogonalize(stack, coefficients, steps, eps)  # wide now: not transposed again
        for i, ortho in zip(indices, stack.unbind()):
            out[i] = ortho.T if tall else ortho
    return out


def adjusted_lr(lr: float, shape: torch.Size, rule: str) -> float:
    """The rate for a matrix of `shape` (out, in): equal update RMS across shapes (see the docstring)."""
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def is_hidden_matrix(name: str, shape) -> bool:
    """Whether Muon updates the parameter `name` of `shape`: a 2-D weight inside a block, not a
    LoRA adapter (accounting/pipeline.py counts a stage's by the same rule)."""
    return (len(shape) == 2 and canonical_name(name).startswith("blocks.")
            and not name.endswith((".lora_A", ".lora_B")))


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[hidden matrices (Muon), embeddings and head (AdamW, decayed), gains and biases (AdamW, no
    decay)], each in the model's parameter order; tied tensors once, frozen ones not at all."""
    named = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p not in named:
            named[p] = name
    muon = [p for p, name in named.items() if is_hidden_matrix(name, p.shape)]
    in_muon = {id(p) for p in muon}
    rest = [p for p in named if id(p) not in in_muon]
    return [{"params": muon, "use_muon": True, "weight_decay": weight_decay},
            {"params": [p for p in rest if p.ndim >= 2], "use_muon": False, "weight_decay": weight_decay},
            {"params": [p for p in rest if p.ndim < 2], "use_muon": False, "weight_decay": 0.0}]


class Muon(AdamW):
    """Muon for the groups with `use_muon`, lmforge's AdamW (the parent class) for the others.

    A group without `use_muon` is AdamW's; its keys (betas, eps) and Muon's (momentum, nesterov,
    ns_steps, ns_coefficients, adjust_lr, lr_multiplier) are defaults of every group. State: a
    Muon parameter's `momentum_buffer` (torch.optim.Muon's name), an AdamW one's step, exp_avg and
    exp_avg_sq."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = NS_STEPS, ns_coefficients=NS_COEFFICIENTS,
                 adjust_lr: str = "original", lr_multiplier: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 count_lost_updates: bool = False, foreach: bool | None = None):
        if not 0.0 <= momentum < 1.0 or ns_steps < 1 or adjust_lr not in ADJUST_LR or lr_multiplier <= 0:
            raise ValueError(f"invalid Muon hyper-parameters: momentum={momentum}, ns_steps={ns_steps}, "
                             f"adjust_lr={adjust_lr} (one of {', '.join(ADJUST_LR)}), lr_multiplier={lr_multiplier}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         count_lost_updates=count_lost_updates, foreach=foreach)
        for group in self.param_groups:
            group.setdefault("use_muon", False)
            for key, value in dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                   ns_coefficients=tuple(ns_coefficients), adjust_lr=adjust_lr,
                                   lr_multiplier=lr_multiplier).items():
                group.setdefault(key, value)
                self.defaults[key] = value
        # None: every Muon parameter is a whole matrix (checked at each step). An engine that hands
        # the optimizer flat pieces of matrices (ZeRO: parallel/whole_matrices.py) or tensor-parallel
        # slices of them (parallel/tp_engine.py) sets its own.
        self.whole_matrices = None

    def _group_step(self, group: dict, counts: list) -> None:
        """AdamW.step's loop calls this per group: Newton-Schulz for the matrices, AdamW for the rest."""
        if not group["use_muon"]:
            return super()._group_step(group, counts)  # AdamW's
        if self.whole_matrices is None and any(p.ndim != 2 for p in group["params"]):
            raise ValueError("Muon updates 2-D matrices only: put other parameters in a group "
                             "without use_muon (AdamW)")
        self._muon_group(group, counts)

    def _muon_group(self, group: dict, counts: list) -> None:
        lr = group["lr"] * group["lr_multiplier"]
        mu, decay = group["momentum"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        updates = []
        for param in params:
            state = self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(param.grad, 1.0 - mu)  # mu B + (1 - mu) G
            updates.append(param.grad.lerp(buf, mu) if group["nesterov"] else buf)  # (1 - mu) G + mu B
        if self.whole_matrices is None:
            orthos = orthogonalize_all(updates, group["ns_coefficients"], group["ns_steps"])
            shapes = [p.shape for p in params]
        else:  # pieces of matrices (ZeRO): the engine gathers, orthogonalises and hands back each piece
            orthos, shapes = self.whole_matrices.orthogonalize(params, updates, group)
        for param, ortho, shape in zip(params, orthos, shapes):
            before = param.clone() if self.count_lost_updates else None
            param.mul_(1.0 - lr * decay)
            param.add_(ortho, alpha=-adjusted_lr(lr, shape, group["adjust_lr"]))
            if before is not None:
                self._count(before, param, ortho, lr * decay != 0, counts)


def build_muon(cfg, policy, param_groups: list[dict]) -> Muon:
    """Muon over `param_groups` from `muon_param_groups` (they say which group is Muon's), with the
    config's AdamW settings for the rest and its optim.muon_* settings for the matrices."""
    o = cfg.optim
    return Muon(param_groups, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, adjust_lr=o.muon_adjust_lr,
                lr_multiplier=o.muon_lr / o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                count_lost_updates=policy.lossy_updates)
