# Two entry points, each from a fresh clone: `make demo` and `make test`.
# Both create .venv (torch's CPU build first, pinned: any other torch spec pulls a CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CHECKOV_VENV ?= .venv-checkov

.PHONY: setup setup-dev demo test lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.[dev,quantize]'
	touch $@

# checkov pins its own versions of common libraries; it gets a venv of its own.
$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/pip install -q 'checkov>=3.2,<4'

setup: $(VENV)/.base

setup-dev: $(VENV)/.dev $(CHECKOV_VENV)/bin/checkov

demo: setup
	$(BIN)/tokenmill demo

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup-dev lint
	TOKENMILL_CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov $(BIN)/pytest

format: setup-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/tokenmill bench

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .ruff_cache
