"""Structured answers: parsing JSON/YAML/XML (parse.py), grammar-constrained decoding (constrain.py), and the
format-restriction study: its task set (tasks.py) and `lmforge eval-format` (evaluate.py; its replies: constrain.py)."""
