"""Sampling with a KV cache (sampling.py); the texts `lmforge generate` prints, one per sample (texts.py)."""
