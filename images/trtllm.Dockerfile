# GPU workers of batch clusters: tokenmill on NVIDIA's TensorRT-LLM 1.2 release container.
#
#   docker build -f images/trtllm.Dockerfile -t REGISTRY/tokenmill-trtllm:TAG .
#
# Installing tokenmill adds packages (Ray, s3fs, ...) and changes none of the container's own:
# the build stops if pip would replace one (images/check_install.py against a dry run). The
# container's versions are recorded in images/pins/trtllm-1.2.txt and resolved against by
# tests/integration/test_install_targets.py. Serve is not installed here: Ray Serve needs a
# newer fastapi than TensorRT-LLM pins (docs/deploy.md); GPU serving uses images/vllm.Dockerfile.
ARG BASE=nvcr.io/nvidia/tensorrt-llm/release:1.2.1
FROM ${BASE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY engines ./engines
COPY pipeline ./pipeline
COPY images/check_install.py ./images/check_install.py

# The extra `trtllm` is already satisfied by the container's TensorRT-LLM: pip keeps it.
# The checkout's requirements are ranges; the base image's own versions pin them (checked
# before anything is installed), so DL3013's version pins do not apply.
# hadolint ignore=DL3013
RUN python -m pip install --dry-run --quiet --report /tmp/plan.json '.[trtllm]' \
    && python images/check_install.py /tmp/plan.json \
    && python -m pip install '.[trtllm]' \
    && rm /tmp/plan.json

# KubeRay pods run as a non-root user (runAsNonRoot in infra/terraform); Ray writes under /tmp.
# UID 1000 may be taken already (user `ubuntu` on Ubuntu 24.04 bases): the script renames it.
COPY images/ray-user.sh ./images/ray-user.sh
RUN sh images/ray-user.sh
USER 1000
WORKDIR /home/ray

# The image's smoke test: versions in range, the reference engine importable. TensorRT-LLM
# itself imports only where the NVIDIA driver is (a GPU node): `tokenmill doctor --require
# trtllm --require fp8` there.
RUN tokenmill doctor --no-import
