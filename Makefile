# The two commands a new machine needs (see README.md):
#   make demo   start local vLLM engines, indexer and router; compare with round-robin
#   make test   ruff, mypy and the whole pytest suite (real Redis, real vLLM engines)
#   make image  build the image from the Dockerfile with buildah (no Docker daemon)
SHELL := /bin/bash
# One cache for make and every script it runs: CACHE=..., else $KVPLANE_CACHE, else ~/.cache/kvplane
CACHE ?= $(or $(KVPLANE_CACHE),$(HOME)/.cache/kvplane)
export KVPLANE_CACHE := $(CACHE)
VENV := $(CACHE)/venv
ROOT := $(abspath .)
PYTEST_ARGS ?=

.PHONY: setup setup-vllm setup-parsers setup-k8s setup-dynamo setup-tools demo test lint typecheck image bench-overhead

setup:
	@bash scripts/bootstrap.sh

setup-vllm: setup
	@bash scripts/setup-vllm.sh

setup-k8s:
	@bash scripts/setup-k8s.sh >/dev/null

# NVIDIA Dynamo, the peer router the routing benchmark and its tests run (about 30 s once)
setup-dynamo:
	@bash scripts/setup-dynamo.sh

# What some tests run for real, each installed or built only if missing: buildah and
# debootstrap (the image), prometheus, Grafana's dashboard schema and the Prometheus
# adapter (dashboards and autoscaling), Jaeger (tracing), the real mooncake_master
# SGLang's and LMCache's own config parsers, over the vLLM venv (the render tests)
setup-parsers: setup-vllm
	@bash scripts/setup-engine-parsers.sh >/dev/null

setup-tools:
	@bash scripts/setup-apt.sh
	@bash scripts/setup-dashboard-schema.sh >/dev/null
	@bash scripts/setup-prometheus-adapter.sh >/dev/null
	@bash scripts/setup-jaeger.sh >/dev/null
	@bash scripts/setup-mooncake.sh >/dev/null

image: setup-tools
	@bash scripts/build-image.sh

demo: setup-vllm
	$(VENV)/bin/kvplane demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy reads the package through the editable link tree (router/ and operator/ are
# mapped into kvplane/), from /tmp so the checkout itself is not on its path.
typecheck: setup
	cd /tmp && $(VENV)/bin/mypy --config-file $(ROOT)/pyproject.toml -p kvplane 2>&1 \
		| sed -E "s#$(ROOT)/build/__editable__[^/]*/kvplane/(router|operator)/#\1/#; s#$(ROOT)/build/__editable__[^/]*/##"; exit $${PIPESTATUS[0]}
	cd /tmp && MYPYPATH=$(ROOT)/tests $(VENV)/bin/mypy --config-file $(ROOT)/pyproject.toml --explicit-package-bases \
		$(ROOT)/tests
	cd /tmp && MYPYPATH=$(ROOT)/tests $(VENV)/bin/mypy --config-file $(ROOT)/pyproject.toml \
		$(ROOT)/e2e/conftest.py $(ROOT)/e2e/test_suite.py

test: setup-vllm setup-parsers setup-k8s setup-dynamo setup-tools lint typecheck
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench-overhead: setup
	$(VENV)/bin/kvplane bench overhead
