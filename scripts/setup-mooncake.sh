#!/usr/bin/env bash
# Idempotent, cached set-up of the real `mooncake_master` (PyPI `mooncake-transfer-engine`,
# whose wheel ships the binary) for the test that starts the operator's rendered master:
#
#   $KVPLANE_CACHE/mooncake-venv     the wheel, installed with --no-deps (only the binary
#                                    is used)
#   $KVPLANE_CACHE/mooncake-libs     the RDMA/NUMA shared libraries the binary links
#                                    (Debian packages unpacked with dpkg -x, no root install)
#
# Prints the binary's path and a LD_LIBRARY_PATH for it (two lines). A stamp file keyed on
# this script's content makes a second run take well under a second.
set -euo pipefail

MOONCAKE_VERSION=0.3.13.post1
DEBS="libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1"

SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
VENV=$CACHE/mooncake-venv
LIBS=$CACHE/mooncake-libs
PY=${PYTHON:-python3}

log() { echo "setup-mooncake: $*" >&2; }

key=$(sha256sum "$SCRIPT" | cut -c1-16)
stamp=$VENV/.kvplane-mooncake-stamp-$key
if [ ! -f "$stamp" ]; then
  log "installing mooncake-transfer-engine $MOONCAKE_VERSION into $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-deps "mooncake-transfer-engine==$MOONCAKE_VERSION" >&2
  mkdir -p "$LIBS"
  # a machine whose package lists were never fetched knows no package: fetch them once
  # shellcheck disable=SC2086
  (cd "$LIBS" && { apt-get download $DEBS >&2 2>/dev/null \
    || { apt-get update -qq >&2 && apt-get download $DEBS >&2; }; })
  for deb in "$LIBS"/*.deb; do dpkg -x "$deb" "$LIBS/root"; done
  touch "$stamp"
fi
binary=$(find "$VENV/lib" -path "*/mooncake/mooncake_master" -type f | head -n1)
echo "$binary"
find "$LIBS/root" -name "*.so*" -printf '%h\n' | sort -u | paste -sd:
