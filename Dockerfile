# syntax=docker/dockerfile:1
# One image for the kvplane operator, router and indexer:
#   docker build -t ghcr.io/kvplane/kvplane:0.1.0 .
#   docker run ghcr.io/kvplane/kvplane:0.1.0 operator | router --config ... | indexer --config ...
# The runtime is the kvplane wheel with its runtime dependencies and the "operator" extra
# (kopf); never the dev extra. tests/test_chart.py checks these invariants and
# tests/test_image.py builds the image (scripts/build-image.sh, buildah, no daemon).
# The base is any image with python3 >= 3.11 and its venv module: python:3.11-slim, or the
# Debian bookworm root filesystem scripts/build-image.sh makes when no registry is reachable.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: the kvplane wheel, then a virtualenv with it and its runtime dependencies ------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvplane/ kvplane/
COPY router/ router/
COPY operator/ operator/
RUN python3 -m venv /opt/kvplane \
    && /opt/kvplane/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/kvplane/bin/pip install --no-compile "$(ls /wheels/kvplane-*.whl)[operator]" \
    && /opt/kvplane/bin/pip install --no-compile --no-deps --force-reinstall \
       "opentelemetry-proto==$(/opt/kvplane/bin/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
    && /opt/kvplane/bin/pip uninstall --yes pip setuptools wheel \
    && /opt/kvplane/bin/kvplane --help > /dev/null

# --- runtime --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvplane" \
      org.opencontainers.image.description="kvplane operator, cache-aware router and indexer" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kvplane/kvplane"
COPY --from=build /opt/kvplane /opt/kvplane
RUN mkdir -p /home/kvplane && chown 65532:65532 /home/kvplane
# The venv first on PATH: `kvplane`, and the `python3` that the router's tokenizer init
# container runs (it imports huggingface_hub from the venv).
ENV PATH=/opt/kvplane/bin:$PATH \
    HOME=/home/kvplane \
    HF_HOME=/tmp/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/kvplane
USER 65532:65532
# router 8000, indexer metrics 9090, operator liveness 8080
EXPOSE 8000 8080 9090
ENTRYPOINT ["kvplane"]
CMD ["--help"]
