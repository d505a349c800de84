# `make train` and `make test` work on a fresh clone: they create .venv, install the CPU build of
# torch (pinned, so that pip does not pull a multi-GB CUDA build) and lmforge, then run.
# The triton extra lets the tests run the flash_triton kernels in Triton's CPU interpreter.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup train test test-all bench bench-attention clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test,triton]"
	touch $@

train: setup
	$(BIN)/lmforge train

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: setup
	$(BIN)/python bench/throughput.py

bench-attention: setup
	$(BIN)/python bench/attention.py

clean:
	rm -rf $(VENV) bench/out .pytest_cache
