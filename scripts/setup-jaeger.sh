#!/usr/bin/env bash
# Idempotent, cached build of Jaeger all-in-one (github.com/jaegertracing/jaeger, pinned in
# tools/jaeger/go.mod) from the Go module proxy: the real OTLP receiver and trace store
# that tests/test_tracing.py exports the router's spans to. Prints the binary's path;
# progress goes to stderr. Several minutes on 2 shared cores the first time.
#   --check   print the path if it is built, else exit 3 without building
# Without a Go toolchain it exits 3 (the tracing tests against Jaeger then skip).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD=$ROOT/tools/jaeger
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}/jaeger
BIN=$CACHE/jaeger-all-in-one
log() { echo "setup-jaeger: $*" >&2; }
want=$(cat "$MOD/go.mod" "$MOD/go.sum" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
if [ -x "$BIN" ] && [ "$(cat "$CACHE/.stamp" 2>/dev/null)" = "$want" ]; then
  echo "$BIN"
  exit 0
fi
[ "${1:-}" = --check ] && { log "$BIN is missing or stale"; exit 3; }
GO=$(command -v go || command -v /usr/local/go/bin/go || true)
[ -n "$GO" ] || { log "no Go toolchain"; exit 3; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [ -x "$BIN" ] && [ "$(cat "$CACHE/.stamp" 2>/dev/null)" = "$want" ]; then
  echo "$BIN"
  exit 0
fi
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
t=$SECONDS
log "building Jaeger all-in-one (module proxy; first run takes several minutes)"
(cd "$MOD" && nice -n 15 "$GO" build -trimpath -ldflags "-s -w" -o "$BIN.tmp" \
  github.com/jaegertracing/jaeger/cmd/all-in-one) >&2
mv -f "$BIN.tmp" "$BIN"
echo "$want" >"$CACHE/.stamp"
log "built in $((SECONDS - t)) s"
echo "$BIN"
