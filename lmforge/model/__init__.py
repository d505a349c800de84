"""The transformer (transformer.py), its attention backends (attention.py) and initialisation (init.py)."""
