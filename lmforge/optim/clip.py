"""Gradient clipping by global norm (Pascanu et al. 2013, Algorithm 1): if ||g|| > c, g <- g * c / ||g||,
with ||g|| the L2 norm of all gradients taken together, so the update keeps its direction."""

import torch


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, sum_across_ranks=None) -> torch.Tensor:
    """Scale gradients in place so that their global L2 norm is at most `max_norm` (0: no
    clipping); returns the norm before clipping.

    Gradients sharded across ranks (each rank holds a disjoint part): `sum_across_ranks` sums a
    tensor over the ranks in place, and ||g||^2 is the sum of the ranks' local ||g_r||^2."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and sum_across_ranks is None:
        return torch.tensor(0.0)
    # each norm in at least fp32: squares of bf16/fp16 gradients overflow or lose the small ones
    norms = [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if sum_across_ranks is not None:
        squares = total_norm.square()
        sum_across_ranks(squares)
        total_norm = squares.sqrt()
    scale_to_norm(grads, total_norm, max_norm)
    return total_norm


@torch.no_grad()
def scale_to_norm(grads, total_norm: torch.Tensor, max_norm: float) -> None:
    """g <- g * min(1, max_norm / ||g||) for each of `grads`, given their global norm (0: no clipping)."""
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
