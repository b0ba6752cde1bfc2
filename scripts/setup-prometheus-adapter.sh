#!/usr/bin/env bash
# Idempotent, cached build of the Prometheus adapter (sigs.k8s.io/prometheus-adapter,
# pinned in tools/prometheus-adapter/go.mod) from the Go module proxy, for the test that
# serves kvplane's autoscaling signals through it (tests/test_dashboards.py). Prints the
# binary's path; progress goes to stderr. About 4 minutes on 2 shared cores the first time.
#   --check   print the path if it is built, else exit 3 without building
# Without a Go toolchain it exits 3 (the test then skips with that reason).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD=$ROOT/tools/prometheus-adapter
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}/prometheus-adapter
BIN=$CACHE/adapter
log() { echo "setup-prometheus-adapter: $*" >&2; }
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
log "building the Prometheus adapter (module proxy; first run ~4 min)"
(cd "$MOD" && nice -n 15 "$GO" build -trimpath -ldflags "-s -w" -o "$BIN.tmp" \
  sigs.k8s.io/prometheus-adapter/cmd/adapter) >&2
mv -f "$BIN.tmp" "$BIN"
echo "$want" >"$CACHE/.stamp"
log "built in $((SECONDS - t)) s"
echo "$BIN"
