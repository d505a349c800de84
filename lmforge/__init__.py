"""lmforge: build language models from scratch and know what every step costs."""

__version__ = "0.1.0"
