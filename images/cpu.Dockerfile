# Ray heads, CPU workers, the Serve ingress and the nightly submitter: tokenmill on a slim
# Python, with the same Python, Ray and pure-Python versions as the GPU image it runs beside.
#
#   # beside images/trtllm.Dockerfile (batch clusters, the nightly submitter):
#   docker build -f images/cpu.Dockerfile -t REGISTRY/tokenmill-cpu:TAG-trtllm .
#   # beside images/trtllm.Dockerfile serving (Serve clusters with serve_engine "trtllm"):
#   docker build -f images/cpu.Dockerfile --build-arg OVERRIDE=trtllm-1.2-serve \
#     --build-arg EXTRAS=serve -t REGISTRY/tokenmill-cpu:TAG-trtllm-serve .
#   # beside images/vllm.Dockerfile (Serve clusters: the Serve controller and proxy run here):
#   docker build -f images/cpu.Dockerfile --build-arg PINS=vllm-0.32-cuda \
#     --build-arg TORCH=2.13.0 --build-arg EXTRAS=serve -t REGISTRY/tokenmill-cpu:TAG-vllm .
#
# Every node of a Ray cluster must run the same Python minor version and Ray: the engine
# vendors' images run Python 3.12. The GPU image's pins (images/pins/) are the constraints here,
# with its CUDA torch swapped for the CPU build of the same release, so rows pickled on one
# side load on the other.
FROM python:3.12-slim

ARG PINS=trtllm-1.2
ARG TORCH=2.9.0
ARG EXTRAS=""
# A pins file whose lines replace PINS' for the same packages (images/constraints.py):
# trtllm-1.2-serve for the head beside the TensorRT-LLM image's Serve environment.
ARG OVERRIDE=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY engines ./engines
COPY pipeline ./pipeline
COPY images/pins ./images/pins
COPY images/constraints.py ./images/constraints.py

RUN python images/constraints.py "images/pins/${PINS}.txt" \
        ${OVERRIDE:+"images/pins/${OVERRIDE}.txt"} | grep -v '^torch==' > /tmp/constraints.txt \
    && echo "torch==${TORCH}+cpu" >> /tmp/constraints.txt \
    && python -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH}+cpu" \
    && python -m pip install -c /tmp/constraints.txt ".${EXTRAS:+[${EXTRAS}]}" \
    && python -m pip check \
    && rm /tmp/constraints.txt

# UID 1000 may be taken already (user `ubuntu` on Ubuntu 24.04 bases): the script renames it.
COPY images/ray-user.sh ./images/ray-user.sh
RUN sh images/ray-user.sh
USER 1000
WORKDIR /home/ray

RUN tokenmill doctor --no-import
