"""Formats of other tools: Hugging Face transformers and PEFT."""
