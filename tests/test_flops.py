import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmforge.accounting.flops import forward_flops_per_token, training_flops_per_token
from lmforge.config import make_config
from lmforge.model.transformer import Transformer


@pytest.mark.parametrize("overrides, seq_len", [
    ([], 64),                                                                     # tiny llama, GQA 4:2
    (["model.n_layers=3", "model.d_model=96", "model.n_heads=6", "model.n_kv_heads=3"], 48),
    (["model.n_kv_heads=1", "model.d_ff=200", "model.tie_embeddings=false"], 17),  # MQA, odd length
    (["model.family=gpt", "model.n_kv_heads=null"], 64),                           # biases, GELU MLP
    (["model.d_model=128", "model.n_heads=2", "model.max_seq_len=256"], 256),     # attention-heavy
])
def test_analytic_training_flops_match_flop_counter(overrides, seq_len):
    # the naive backend, so that attention runs as matmuls FlopCounterMode has formulas for
    cfg = make_config("tiny", overrides=overrides + ["model.attention=naive"]).model
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len + 1))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    measured = counter.get_total_flops() / tokens[:, :-1].numel()
    predicted = training_flops_per_token(cfg, seq_len)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
    assert training_flops_per_token(cfg, seq_len) == 3 * forward_flops_per_token(cfg, seq_len)


def test_palm_formula_for_a_published_shape():
    """6N + 12*L*H*Q*T (Chowdhery et al. 2022, appendix B), N the non-embedding matrices plus the
    head, agrees with the per-component count for Llama-2 7B."""
    cfg = make_config("llama2-7b").model
    seq_len = 4096
    with torch.device("meta"):
        n = Transformer(cfg).num_params(embeddings=False)
    n_matrices = n - cfg.n_layers * 2 * cfg.d_model - cfg.d_model  # norm gains are not matmul weights
    palm = 6 * n_matrices + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    assert training_flops_per_token(cfg, seq_len) == palm
