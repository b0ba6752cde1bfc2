//go:build tools

// Package tools pins the Prometheus adapter (kubernetes-sigs/prometheus-adapter) that
// scripts/setup-prometheus-adapter.sh builds from the Go module proxy.
package tools

import _ "sigs.k8s.io/prometheus-adapter/cmd/adapter"
