#!/usr/bin/env bash
# Idempotent install of the Debian packages some tests run for real:
#   buildah, debootstrap   tests/test_image.py builds the image (scripts/build-image.sh)
#   prometheus             tests/test_dashboards.py runs every dashboard query on it
# Installs only what is missing (a second run costs a few `command -v`), so `make test`
# calls it every time. Without root or apt it says so and exits 0: those tests then skip
# with that reason.
set -euo pipefail
declare -A PKG=([buildah]=buildah [debootstrap]=debootstrap [prometheus]=prometheus)
log() { echo "setup-apt: $*" >&2; }

missing=()
for cmd in "${!PKG[@]}"; do
  command -v "$cmd" >/dev/null || missing+=("${PKG[$cmd]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  log "not installing ${missing[*]} (needs root and apt-get); the tests that need them skip"
  exit 0
fi
log "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's prometheus package starts its service where there is an init system; the tests
# run their own Prometheus on a free port, so a packaged one is not needed.
