#!/usr/bin/env bash
# Idempotent set-up of everything the router, the demo and the tests need:
# redis-server (Debian package) and a virtualenv in ~/.cache/kvplane/venv with
# kvplane installed in strict editable mode. A second run only refreshes the
# editable link tree (new modules), which takes a second or two.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
VENV=$CACHE/venv
PY=${PYTHON:-python3}
mkdir -p "$CACHE"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "bootstrap: installing redis-server (Debian package)" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  # the package starts a system service; tests start their own on free ports
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.deps-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing kvplane and its dependencies into $VENV" >&2
  "$VENV/bin/pip" install -q -U pip setuptools wheel
  "$VENV/bin/pip" install -q -e "$ROOT[dev,operator]" --config-settings editable_mode=strict \
    2> >(grep -v -e BuildBackendWarning -e '^ *!!' -e '^ *\*\*\*' >&2)
  # xds-protos (the endpoint picker's Envoy protobufs) ships an older copy of the
  # opentelemetry/proto modules over opentelemetry-proto's (which the OTLP exporter needs)
  # when pip happens to install it second: put opentelemetry-proto's own files back
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "opentelemetry-proto==$(
    "$VENV/bin/python" -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
  rm -f "$VENV"/.deps-*
  touch "$stamp"
else
  # refresh the link tree for new modules; pip is chatty about strict mode
  log=$(mktemp)
  if ! "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" \
      --config-settings editable_mode=strict >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
fi
