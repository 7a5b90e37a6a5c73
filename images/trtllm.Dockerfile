# GPU workers of batch clusters: tokenmill on NVIDIA's TensorRT-LLM 1.2 release container.
#
#   docker build -f images/trtllm.Dockerfile -t REGISTRY/tokenmill-trtllm:TAG .
#
# Installing tokenmill adds packages (Ray, s3fs, ...) and changes none of the container's own:
# the build stops if pip would replace one (images/check_install.py against a dry run). The
# container's versions are recorded in images/pins/trtllm-1.2.txt and resolved against by
# tests/integration/test_install_targets.py.
#
# The same image serves with TensorRT-LLM (jobs/serve-gpu-trtllm.yaml): Ray Serve needs a newer
# fastapi than TensorRT-LLM pins (docs/deploy.md), so Serve gets a second environment,
# /opt/serve-env, over the container's Python: it sees every package of the container and adds
# only Serve and the versions in images/pins/trtllm-1.2-serve.txt, in its own site-packages.
# On Serve clusters Ray's processes run under it (PATH=/opt/serve-env/bin:$PATH on the pods,
# infra/terraform serve_engine = "trtllm"); each replica's engine process runs under the
# container's Python (replicas.engine_python: /usr/bin/python3), where TensorRT-LLM is. Batch
# clusters leave PATH alone and never touch it.
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
COPY images/check_install.py images/constraints.py images/entry_points.py ./images/
COPY images/pins ./images/pins

# The extra `trtllm` is already satisfied by the container's TensorRT-LLM: pip keeps it.
# The checkout's requirements are ranges; the base image's own versions pin them (checked
# before anything is installed), so DL3013's version pins do not apply.
# hadolint ignore=DL3013
RUN python -m pip install --dry-run --quiet --report /tmp/plan.json '.[trtllm]' \
    && python images/check_install.py /tmp/plan.json \
    && python -m pip install '.[trtllm]' \
    && rm /tmp/plan.json

# Serve's environment. It gets its own copy of tokenmill from the same checkout (pip always
# installs a local directory), so both sides run the same version. check_install allows only
# that and the packages the override file names to differ from the container's: they land in
# the venv, shadowing the container's copies for Serve's processes only. No pip of its
# own (Ubuntu's Python may lack ensurepip): the container's pip, run by the venv's
# interpreter, installs into the venv. entry_points.py gives the venv its own `ray` and
# `tokenmill`, which pip does not write for packages it found in the container.
# hadolint ignore=DL3013
RUN python -m venv --without-pip --system-site-packages /opt/serve-env \
    && python images/constraints.py images/pins/trtllm-1.2.txt \
        images/pins/trtllm-1.2-serve.txt > /tmp/serve-constraints.txt \
    && /opt/serve-env/bin/python -m pip install --dry-run --quiet --report /tmp/plan.json \
        -c /tmp/serve-constraints.txt '.[serve]' \
    && /opt/serve-env/bin/python images/check_install.py /tmp/plan.json \
        --allow tokenmill --allow fastapi --allow starlette \
    && /opt/serve-env/bin/python -m pip install -c /tmp/serve-constraints.txt '.[serve]' \
    && /opt/serve-env/bin/python images/entry_points.py /opt/serve-env/bin ray tokenmill \
    && rm /tmp/plan.json /tmp/serve-constraints.txt

# KubeRay pods run as a non-root user (runAsNonRoot in infra/terraform); Ray writes under /tmp.
# UID 1000 may be taken already (user `ubuntu` on Ubuntu 24.04 bases): the script renames it.
COPY images/ray-user.sh ./images/ray-user.sh
RUN sh images/ray-user.sh
USER 1000
WORKDIR /home/ray

# The image's smoke test: versions in range, the reference engine importable. TensorRT-LLM
# itself imports only where the NVIDIA driver is (a GPU node): `tokenmill doctor --require
# trtllm --require fp8` there.
RUN tokenmill doctor --no-import \
    && /opt/serve-env/bin/tokenmill doctor --no-import --require serve \
        --engine-python "$(command -v python3)"
