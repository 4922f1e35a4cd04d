# syntax=docker/dockerfile:1
# The image the Helm chart (deploy/helm/pdserve) runs: `pdserve router|prefill|decode`.
#
#   docker build --build-arg VARIANT=cpu  -t pdserve:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .
#
# The variants differ only in their base stage (OS image, Python) and in the PyTorch
# index torch comes from; every other package is pinned by deploy/docker/requirements.lock
# (scripts/lock_image_requirements.py). tests/deploy/test_dockerfile.py checks both.

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0

# -- base stages: one per variant --------------------------------------------------
FROM python:3.11-slim-bookworm AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PYTHON=python3.11

FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 \
    PYTHON=python3

# -- common to both variants -------------------------------------------------------
FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH

FROM base AS builder
ARG TORCH_VERSION
RUN $PYTHON -m venv /opt/pdserve
# torch from the variant's index (the CPU build, or a CUDA build and its CUDA libraries)
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
COPY deploy/docker/requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir -r /tmp/requirements.lock
# The package itself, built with the locked setuptools; its dependencies are already
# there, and pip check proves they fit.
COPY pyproject.toml README.md __init__.py __main__.py cli.py /src/
COPY bench /src/bench
COPY engine /src/engine
COPY kvtransfer /src/kvtransfer
COPY launch /src/launch
COPY planner /src/planner
COPY proto /src/proto
COPY services /src/services
RUN pip install --no-cache-dir --no-deps --no-build-isolation /src \
    && pip check

FROM base AS runtime
COPY --from=builder /opt/pdserve /opt/pdserve
# The small default model, and the default of every --model flag (PDSERVE_MODEL).
COPY models/pdserve-tiny-code /opt/pdserve/models/pdserve-tiny-code
ENV PDSERVE_MODEL=/opt/pdserve/models/pdserve-tiny-code \
    HOME=/tmp
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 50061
ENTRYPOINT ["/opt/pdserve/bin/pdserve"]
CMD ["--help"]
