"""Sampling with a KV cache (sampling.py); the texts `lmforge generate` prints, one per sample (texts.py);
`lmforge chat` (chat.py); the model both read, with its stop tokens and chat template (load.py)."""
