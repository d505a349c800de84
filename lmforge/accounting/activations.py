"""What each model family's own modules save for backward, in bytes: the family-specific terms of
the activation count (memory.py adds the terms every family shares: linear-layer inputs, the
attention core, weight casts, head and loss).

The formulas stay analytic, tensor by tensor, because they are the point: they say why a layer
keeps what it keeps (Korthikanti et al. 2022, section 4), and tests/test_memory.py checks them
to the byte against what autograd saves. One function per family, in a table with the keys and
order of model/transformer.FAMILIES (a test checks that they agree), each naming the modules of
its family it counts. They live here and not beside those modules in model/transformer.py
because they are made of what the model must not know: the bytes of a precision policy and what
a recomputation mode keeps.
"""

from dataclasses import dataclass

from lmforge.config import ModelConfig
from lmforge.modes.precision import Policy


@dataclass(frozen=True)
class FamilyActivations:
    """Bytes a family's own modules save for b sequences of s tokens."""
    block_norms: int  # the two norms of one block
    mlp: int  # one block's MLP: its hidden activations and the down projection's input
    norm_readers: int  # linear layers of a block that read a normalised input (each keeps it, or its cast)
    final_norm: int  # the norm before the LM head
    position_ids: int  # what the embedding keeps to add positions
    position_tables: int  # tables every block reads, kept once (not inside fully recomputed blocks)
    qk_norms: int = 0  # one block's QK-norm (model.qk_norm), on its heads: tensor ranks split it


# One block's MLP by model.mlp (model/transformer.py, model/recipe.py), for bsf = b*s*ffn_dim hidden
# values: (bytes it saves, its linear layers that read the normalised input).
MLP_ACTIVATIONS = {
    # gate and up outputs and silu(gate); their product is the down projection's input
    "swiglu": lambda bsf, p: (3 * bsf * p.compute + bsf * p.linear_input, 2),
    # GELU keeps its input; its output is down's input
    "gelu": lambda bsf, p: (bsf * p.compute + bsf * p.linear_input, 1),
    # ReLU keeps its output, which square() keeps too (one tensor); the square is down's input
    "relu2": lambda bsf, p: (bsf * p.compute + bsf * p.linear_input, 1),
}


def llama_activations(cfg: ModelConfig, b: int, s: int, policy: Policy) -> FamilyActivations:
    """RMSNorm, the MLP of model.mlp (SwiGLU by default) and RotaryTables (model/rope.py); biases
    (model.qkv_bias) keep nothing."""
    p, bsd, bs = policy.bytes, b * s * cfg.d_model, b * s
    mlp_bytes, mlp_readers = MLP_ACTIVATIONS[cfg.mlp_kind](b * s * cfg.ffn_dim, p)
    # RMSNorm runs in fp32 (F.rms_norm decomposes under autograd): the input, 1/rms per row and
    # the normalised x (for the gain's gradient); a gain stored below fp32 is cast up with the
    # input, and the cast is kept too.
    rms_norm = 2 * bsd * 4 + bs * 4 + (cfg.d_model * 4 if p.parameter < 4 else 0)
    # QK-norm (model.qk_norm): the same three tensors for each head's query and key, one per head and row
    heads = cfg.n_heads + cfg.kv_heads
    qk_norms = 2 * bs * heads * cfg.head_dim * 4 + bs * heads * 4 + (2 * cfg.head_dim * 4 if p.parameter < 4 else 0)
    return FamilyActivations(
        block_norms=2 * rms_norm,
        qk_norms=qk_norms if cfg.qk_norm else 0,
        mlp=mlp_bytes,
        norm_readers=3 + mlp_readers,  # q, k, v and the MLP's input projections
        final_norm=rms_norm,
        position_ids=0,  # rotary: positions enter through the tables
        position_tables=2 * cfg.max_seq_len * cfg.head_dim * 4,  # fp32 cos and sin
    )


def gpt_activations(cfg: ModelConfig, b: int, s: int, policy: Policy) -> FamilyActivations:
    """LayerNorm, the MLP of model.mlp (GeluMLP by default) and learned positions (model/transformer.py);
    biases keep nothing."""
    p, bsd, bs = policy.bytes, b * s * cfg.d_model, b * s
    mlp_bytes, mlp_readers = MLP_ACTIVATIONS[cfg.mlp_kind](b * s * cfg.ffn_dim, p)
    # LayerNorm, in the residual stream's dtype: the input, mean and 1/std per row
    layer_norm = (bsd + 2 * bs) * p.residual
    return FamilyActivations(
        block_norms=2 * layer_norm,
        mlp=mlp_bytes,
        norm_readers=3 + mlp_readers,  # q, k, v and the MLP's input projections
        final_norm=layer_norm,
        position_ids=s * 8,  # the int64 positions the position table gathers
        position_tables=0,
    )


FAMILY_ACTIVATIONS = {"llama": llama_activations, "gpt": gpt_activations}
