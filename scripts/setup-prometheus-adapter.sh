#!/usr/bin/env bash
# The Prometheus adapter (sigs.k8s.io/prometheus-adapter, pinned in
# tools/prometheus-adapter/go.mod), built once from the Go module proxy by go-tool.sh, for
# the test that serves kvplane's autoscaling signals through it (tests/test_dashboards.py).
# Prints the binary's path.
#   --check   print the path if it is built, else exit 3 without building
exec bash "$(dirname "${BASH_SOURCE[0]}")/go-tool.sh" prometheus-adapter \
  sigs.k8s.io/prometheus-adapter/cmd/adapter adapter "$@"
