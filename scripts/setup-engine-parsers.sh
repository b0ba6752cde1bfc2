#!/usr/bin/env bash
# Idempotent, cached set-up of the engines' own config parsers, for the tests that feed
# them what the operator renders:
#
#   $KVPLANE_CACHE/engine-parsers-venv   SGLang (its ServerArgs command-line parser) and
#                                        LMCache (its config loader), both --no-deps
#
# Both need torch, pydantic, numpy and friends only to import; those come from the vLLM
# virtualenv (scripts/setup-vllm.sh, run first), which a .pth file appends to this venv's
# path, so nothing heavy is installed twice and the vLLM venv itself stays untouched. Only
# the few modules the two import that vLLM lacks are added. Prints the venv's python.
# A stamp file keyed on this script's content makes a second run take well under a second.
set -euo pipefail

PACKAGES=(sglang==0.5.23 lmcache==0.5.6 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1
  sortedcontainers==2.4.0 aiofile==3.12.3 caio==0.12.10 awscrt==0.38.1)

SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
VLLM=$CACHE/vllm-venv
VENV=$CACHE/engine-parsers-venv

log() { echo "setup-engine-parsers: $*" >&2; }

bash "$(dirname "$SCRIPT")/setup-vllm.sh"
key=$(sha256sum "$SCRIPT" | cut -c1-16)
stamp=$VENV/.kvplane-parsers-stamp-$key
if [ ! -f "$stamp" ]; then
  cd "$CACHE"  # not the checkout: its operator/ package shadows the standard library's
  exec 9>"$CACHE/.engine-parsers-venv.lock"
  flock -w 1800 9
  if [ ! -f "$stamp" ]; then
    log "installing ${PACKAGES[*]} into $VENV"
    # the vLLM venv's interpreter: the same Python its site-packages were built for
    [ -x "$VENV/bin/python" ] || "$VLLM/bin/python" -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-deps "${PACKAGES[@]}" >&2
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$VLLM/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
      >"$site/zz-kvplane-vllm-venv.pth"
    "$VENV/bin/python" -P -c 'import sglang.srt.server_args, lmcache.v1.config' >&2
    "$VENV/bin/python" -P -c 'import lmcache.v1.storage_backend.connector.s3_connector' >&2
    touch "$stamp"
  fi
fi
echo "$VENV/bin/python"
