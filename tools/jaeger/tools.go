//go:build tools

// Package tools pins Jaeger all-in-one (jaegertracing/jaeger), which
// scripts/setup-jaeger.sh builds from the Go module proxy.
package tools

import _ "github.com/jaegertracing/jaeger/cmd/all-in-one"
