#!/usr/bin/env bash
# Jaeger all-in-one (github.com/jaegertracing/jaeger, pinned in tools/jaeger/go.mod), built
# once from the Go module proxy by go-tool.sh: the real OTLP receiver and trace store that
# tests/test_tracing.py exports the router's spans to. Prints the binary's path.
#   --check   print the path if it is built, else exit 3 without building
exec bash "$(dirname "${BASH_SOURCE[0]}")/go-tool.sh" jaeger \
  github.com/jaegertracing/jaeger/cmd/all-in-one jaeger-all-in-one "$@"
