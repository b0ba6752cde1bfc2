#!/usr/bin/env bash
# Idempotent, cached build of a Go program pinned by a module under tools/ (go.mod, go.sum),
# from the Go module proxy, for the tests that run it for real:
#   go-tool.sh NAME PACKAGE BINARY [--check]
# builds PACKAGE of tools/NAME into $KVPLANE_CACHE/NAME/BINARY once per pinned version
# (and build flags) and prints the binary's path; progress goes to stderr.
#   --check   print the path if it is built, else exit 3 without building
# Without a Go toolchain it exits 3 (the tests that need the program then skip).
set -euo pipefail
name=$1 package=$2 binary=$3 check=${4:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD=$ROOT/tools/$name
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}/$name
BIN=$CACHE/$binary
FLAGS="-trimpath -ldflags=-s -w CGO_ENABLED=0"
log() { echo "setup-$name: $*" >&2; }
want=$( (cat "$MOD/go.mod" "$MOD/go.sum"; echo "$package $FLAGS") | sha256sum | cut -c1-16)
built() { [ -x "$BIN" ] && [ "$(cat "$CACHE/.stamp" 2>/dev/null)" = "$want" ]; }
if built; then echo "$BIN"; exit 0; fi
[ "$check" = --check ] && { log "$BIN is missing or stale"; exit 3; }
GO=$(command -v go || command -v /usr/local/go/bin/go || true)
[ -n "$GO" ] || { log "no Go toolchain"; exit 3; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if built; then echo "$BIN"; exit 0; fi  # another run built it while this one waited
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
t=$SECONDS
log "building $package (module proxy; the first build takes minutes on 2 shared cores)"
(cd "$MOD" && nice -n 15 "$GO" build -trimpath -ldflags "-s -w" -o "$BIN.tmp" "$package") >&2
mv -f "$BIN.tmp" "$BIN"
echo "$want" >"$CACHE/.stamp"
log "built in $((SECONDS - t)) s"
echo "$BIN"
