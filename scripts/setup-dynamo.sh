#!/usr/bin/env bash
# Idempotent, cached set-up of a separate virtualenv with NVIDIA Dynamo (PyPI
# `ai-dynamo` + `ai-dynamo-runtime`), the peer router `kvplane bench routing`
# compares kvplane with (kvplane/bench/peers/dynamo):
#
#   $KVPLANE_CACHE/dynamo-venv   (KVPLANE_CACHE defaults to ~/.cache/kvplane)
#
# Recipe (`pip install ai-dynamo` fails: its dependency `aisimulate` is a
# placeholder whose real wheel lives on another index, unreachable here; it is only
# needed for the mocker's `--ais-perf-model`):
#   1. download the two wheels and install them with --no-deps;
#   2. install their non-extra Requires-Dist, read from their METADATA, except
#      `aisimulate` and the two wheels themselves (environment markers kept).
#
# A stamp file keyed on this script's content makes a second run take well under a
# second. Progress goes to stderr. Override the interpreter with $PYTHON (3.10+).
set -euo pipefail

DYNAMO_VERSION=1.6.1
DROP_PACKAGES="aisimulate ai-dynamo ai-dynamo-runtime"

SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
VENV=$CACHE/dynamo-venv
WHEELS=$CACHE/wheels
PY=${PYTHON:-python3}

log() { echo "setup-dynamo: $*" >&2; }

key=$(sha256sum "$SCRIPT" | cut -c1-16)
stamp=$VENV/.kvplane-dynamo-stamp-$key
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

mkdir -p "$WHEELS"
# Work from the cache: the project root has an `operator/` package that shadows the
# standard library module of that name for `python -m ...`.
cd "$CACHE"
exec 9>"$CACHE/.dynamo-venv.lock"
if ! flock -w 3600 9; then
  log "timed out waiting for $CACHE/.dynamo-venv.lock"
  exit 1
fi
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV with $("$PY" -V 2>&1)"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
VPIP=("$VPY" -m pip --disable-pip-version-check)

wheels=()
for pkg in ai_dynamo_runtime ai_dynamo; do
  wheel=$(ls "$WHEELS"/"$pkg"-"$DYNAMO_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    log "downloading ${pkg//_/-}==$DYNAMO_VERSION (wheel only)"
    "${VPIP[@]}" download -q --no-deps --only-binary=:all: -d "$WHEELS" \
      "${pkg//_/-}==$DYNAMO_VERSION"
    wheel=$(ls "$WHEELS"/"$pkg"-"$DYNAMO_VERSION"-*.whl | head -n1)
  fi
  wheels+=("$wheel")
done
log "using $(basename "${wheels[0]}") and $(basename "${wheels[1]}")"

reqs=$VENV/.kvplane-dynamo-requirements.txt
"$VPY" - "$DROP_PACKAGES" "${wheels[@]}" >"$reqs" <<'PYEOF'
import re
import sys
import zipfile
from email.parser import HeaderParser

drop = set(sys.argv[1].split())
seen = set()
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = HeaderParser().parsestr(zf.read(meta_name).decode("utf-8"))
    for raw in meta.get_all("Requires-Dist") or []:
        spec, sep, marker = raw.partition(";")
        spec, marker = spec.strip(), marker.strip()
        if re.search(r"\bextra\s*==", marker):
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
        if m is None:
            sys.exit(f"cannot parse requirement {raw!r}")
        name = re.sub(r"[-_.]+", "-", m.group(0)).lower()
        if name in drop or (spec, marker) in seen:
            continue
        seen.add((spec, marker))
        print(f"{spec} ; {marker}" if marker else spec)
PYEOF
log "installing $(wc -l <"$reqs") requirements of ai-dynamo: $(tr '\n' ' ' <"$reqs")"
"${VPIP[@]}" install -q -r "$reqs"
log "installing ai-dynamo-runtime and ai-dynamo $DYNAMO_VERSION (--no-deps)"
"${VPIP[@]}" install -q --no-deps "${wheels[@]}"

log "checking the installation"
got=$("$VPY" -c '
import importlib.metadata as md
from dynamo.llm import SelectionService  # noqa: F401  (the selector the peer drives)
print("ai-dynamo", md.version("ai-dynamo"), "ai-dynamo-runtime", md.version("ai-dynamo-runtime"))
' | tail -n1)
log "$got"
case "$got" in
  "ai-dynamo $DYNAMO_VERSION ai-dynamo-runtime $DYNAMO_VERSION") ;;
  *) log "unexpected versions"; exit 1 ;;
esac

rm -f "$VENV"/.kvplane-dynamo-stamp-*
touch "$stamp"
log "done in $((SECONDS - start)) s"
