"""Named model presets (`--model NAME`): published shapes, each a set of ModelConfig fields."""

# Llama 3.1's rotary rescaling as its released config.json gives it (Llama 3.2 1B/3B: factor 32)
LLAMA3_ROPE_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# Published shapes. The large ones are for planning; training them here is not the point.
MODEL_PRESETS: dict[str, dict] = {
    # For tests: trains in seconds.
    "tiny": dict(family="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 max_seq_len=64),
    # The default of `lmforge train`: about 8 minutes on a 2-core CPU (bench/RESULTS.md).
    "small": dict(family="llama", vocab_size=4096, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2,
                  max_seq_len=256),
    # Radford et al. 2019 (GPT-2), table 2; context 1024, vocabulary 50257, tied embeddings.
    "gpt2-124m": dict(family="gpt", vocab_size=50257, d_model=768, n_layers=12, n_heads=12,
                      max_seq_len=1024),
    "gpt2-350m": dict(family="gpt", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16,
                      max_seq_len=1024),
    # Brown et al. 2020 (GPT-3), table 2.1: 96 layers, d_model 12288, 96 heads, context 2048.
    "gpt3-175b": dict(family="gpt", vocab_size=50257, d_model=12288, n_layers=96, n_heads=96,
                      max_seq_len=2048),
    # Llama 3.2 1B (Meta model card / released config): tied embeddings, rope_theta 5e5.
    "llama3-1b": dict(family="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                      n_kv_heads=8, d_ff=8192, max_seq_len=8192, rope_theta=500000.0,
                      rope_scaling=dict(LLAMA3_ROPE_SCALING, factor=32.0)),
    # Touvron et al. 2023 (Llama 2), table 1 and released config.
    "llama2-7b": dict(family="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=32, d_ff=11008, max_seq_len=4096, tie_embeddings=False),
    # Dubey et al. 2024 (The Llama 3 Herd of Models), table 3.
    "llama3-8b": dict(family="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                      tie_embeddings=False),
    "llama3-70b": dict(family="llama", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, d_ff=28672, max_seq_len=8192, rope_theta=500000.0,
                       tie_embeddings=False),
}
DEFAULT_PRESET = "small"
