# GPU replicas of Serve clusters (and engine.kind vllm batch workers): tokenmill with Serve on
# vLLM's 0.32 CUDA image.
#
#   docker build -f images/vllm.Dockerfile -t REGISTRY/tokenmill-vllm:TAG .
#
# Installing tokenmill changes none of the image's packages (the build stops if pip would:
# images/check_install.py); the image's pins are recorded in images/pins/vllm-0.32-cuda.txt.
ARG BASE=vllm/vllm-openai:v0.32.0
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

# The checkout's requirements are ranges; the base image's own versions pin them (checked
# before anything is installed), so DL3013's version pins do not apply.
# hadolint ignore=DL3013
RUN python3 -m pip install --dry-run --quiet --report /tmp/plan.json '.[serve,vllm]' \
    && python3 images/check_install.py /tmp/plan.json \
    && python3 -m pip install '.[serve,vllm]' \
    && rm /tmp/plan.json

# UID 1000 may be taken already (user `ubuntu` on Ubuntu 24.04 bases): the script renames it.
COPY images/ray-user.sh ./images/ray-user.sh
RUN sh images/ray-user.sh
USER 1000
WORKDIR /home/ray

# vLLM's image starts `vllm serve`; KubeRay gives the container its own command.
ENTRYPOINT []
CMD ["bash"]

RUN tokenmill doctor --no-import
