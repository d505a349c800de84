"""Formats of other tools, Hugging Face transformers and PEFT, and nothing else (below runs/, which
turns them into run folders):

    hf.py            a Hugging Face model folder in and out (`import_hf`, `export_hf`), its tokenizer files
                     and end-of-text token
    hf_names.py      lmforge's parameter names and layouts against HF's, per family
    hf_config.py     config.json to and from ModelConfig; the folder's JSON files read one way
    peft.py          LoRA adapters in PEFT's layout
"""
