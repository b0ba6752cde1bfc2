#!/usr/bin/env bash
# Build the kvplane image from the Dockerfile without a Docker daemon: buildah (Debian's
# package) with the vfs storage driver and chroot isolation, so it runs unprivileged
# inside a container too. No container registry is needed: the Dockerfile's base
# (ARG PYTHON_IMAGE, python:3.11-slim by default) is replaced by a minimal Debian bookworm
# root filesystem with python3.11, built once with debootstrap from Debian's packages and
# kept as a local image.
#
#   scripts/build-image.sh            build localhost/kvplane:dev (the base once, cached)
#   scripts/build-image.sh --check    exit 0 if the builder can run here, else 3 with why
#
# Everything lives under ${KVPLANE_CACHE:-$HOME/.cache/kvplane}/image: buildah's storage
# (storage/, run/), the base's stamp. Environment: KVPLANE_IMAGE_TAG (default
# localhost/kvplane:dev), DEBIAN_MIRROR (default http://deb.debian.org/debian). A host CA
# bundle (PIP_CERT or /etc/ssl/certs/ca-certificates.crt) is mounted over the image's during
# the build's RUN steps only, so pip works behind a TLS-inspecting proxy; nothing of it is
# committed. Progress goes to stderr; the image's tag is printed on stdout.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}/image
TAG=${KVPLANE_IMAGE_TAG:-localhost/kvplane:dev}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
# python3-venv brings ensurepip's pip wheel, which the build stage's `python3 -m venv` needs
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE_KEY=$(printf '%s %s %s' "$SUITE" "$BASE_PACKAGES" 1 | sha256sum | cut -c1-12)
BASE=localhost/kvplane-base:$SUITE-$BASE_KEY

log() { echo "build-image: $*" >&2; }
need() { command -v "$1" >/dev/null || { log "$1 is not installed ($2)"; return 3; }; }

B=(buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver vfs)

check() {
  need buildah "apt-get install buildah" || return 3
  need debootstrap "apt-get install debootstrap" || return 3
  [ "$(id -u)" = 0 ] || { log "debootstrap needs root"; return 3; }
  mkdir -p "$CACHE"
  "${B[@]}" info >/dev/null 2>"$CACHE/check.err" || { log "buildah cannot run: $(tail -1 "$CACHE/check.err")"; return 3; }
}

if [ "${1:-}" = --check ]; then
  check
  exit $?
fi
check || exit 3

exec 9>"$CACHE/.lock"
flock 9

if ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  start=$SECONDS
  rootfs=$CACHE/rootfs.tmp
  rm -rf "$rootfs"
  log "debootstrap $SUITE ($BASE_PACKAGES) from $MIRROR"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
    >"$CACHE/debootstrap.log" 2>&1 || { log "debootstrap failed: see $CACHE/debootstrap.log"; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
  log "importing the root filesystem as $BASE"
  tar -C "$rootfs" --numeric-owner -cf "$CACHE/rootfs.tar" .
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" add "$ctr" "$CACHE/rootfs.tar" / >/dev/null
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
  "${B[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -rf "$rootfs" "$CACHE/rootfs.tar"
  log "base image built in $((SECONDS - start))s"
fi

ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
mounts=()
[ -f "$ca" ] && mounts=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
start=$SECONDS
log "building $TAG from $ROOT (base $BASE)"
"${B[@]}" bud --isolation chroot --layers=false --quiet \
  --build-arg PYTHON_IMAGE="$BASE" "${mounts[@]}" \
  -f "$ROOT/Dockerfile" -t "$TAG" "$ROOT" >"$CACHE/build.log" 2>&1 \
  || { tail -30 "$CACHE/build.log" >&2; log "build failed: $CACHE/build.log"; exit 1; }
# drop the previous build's now untagged image (vfs keeps every layer as a full copy)
"${B[@]}" rmi --prune >/dev/null 2>&1 || true
log "image built in $((SECONDS - start))s"
echo "$TAG"
