#!/usr/bin/env bash
# Idempotent install of Grafana's published dashboard schema (npm @grafana/schema: the
# TypeScript types generated from Grafana's CUE dashboard kind) and the TypeScript
# compiler that checks the chart's dashboards against it (tests/test_dashboards.py).
# Into ${KVPLANE_CACHE:-$HOME/.cache/kvplane}/grafana-schema; prints that directory.
# Without npm it says so and exits 0 (the schema test then skips with that reason).
set -euo pipefail
SCHEMA_VERSION=13.2.3
TYPESCRIPT_VERSION=5.9.3
DIR=${KVPLANE_CACHE:-$HOME/.cache/kvplane}/grafana-schema
stamp=$DIR/.stamp-$SCHEMA_VERSION-$TYPESCRIPT_VERSION
if [ -f "$stamp" ]; then
  echo "$DIR"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "setup-dashboard-schema: npm is not installed; the dashboard schema test skips" >&2
  exit 0
fi
mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9
[ -f "$stamp" ] || {
  echo '{"private": true}' >"$DIR/package.json"
  npm install --prefix "$DIR" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "@grafana/schema@$SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION" >&2
  touch "$stamp"
}
echo "$DIR"
