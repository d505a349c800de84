"""Structured answers: parsing JSON/YAML/XML (parse.py) and grammar-constrained decoding (constrain.py)."""
