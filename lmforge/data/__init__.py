"""Corpora (corpus.py), the BPE tokenizer (tokenizer.py), token files (tokens.py), preparation
(prepare.py) and the batch loader (loader.py)."""
