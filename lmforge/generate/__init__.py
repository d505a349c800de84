"""Sampling with a KV cache (sampling.py)."""
