"""Formats of other tools, Hugging Face transformers and PEFT, and nothing else (below runs/, which
turns them into run folders):

    hf.py            a Hugging Face model folder in and out (`import_hf`, `export_hf`)
    hf_names.py      lmforge's parameter names and layouts against HF's, per family
    hf_config.py     config.json to and from ModelConfig; the folder's JSON files read one way
    hf_tokenizer.py  tokenizer.json, tokenizer_config.json and the end-of-text token
    peft.py          LoRA adapters in PEFT's layout
"""
