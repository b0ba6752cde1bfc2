#!/usr/bin/env bash
# Idempotent, cached build of an offline Kubernetes control plane for the operator tests:
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, etcdctl, kwok and
# helm, all from the Go modules pinned in tools/k8s/go.mod (module proxy only, no Docker,
# no GitHub downloads). Binaries land in
#   ${KVPLANE_CACHE:-$HOME/.cache/kvplane}/k8s/<k8s-version>/bin
# and that directory is printed on stdout; progress goes to stderr.
#
# A stamp (hash of go.mod, go.sum and this script) makes a second run instant.
#   --check   print the bin dir if it is up to date, else exit 3 without building
#   --force   rebuild even if the stamp matches
# Environment: GO (go binary), KVPLANE_CACHE, GOPROXY/GOSUMDB/GONOSUMDB (passed through),
# KVPLANE_K8S_PRUNE=1 (delete the ~5 GB of Go module/build caches after a good build).
# First build from scratch: ~1 GB module download, then about 12 min on 2 shared cores
# (see docs/k8s-test-env.md for measured numbers).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD=$ROOT/tools/k8s
CACHE=${KVPLANE_CACHE:-$HOME/.cache/kvplane}
K8S_CACHE=$CACHE/k8s
MODE=build
case "${1:-}" in
  "") ;;
  --check) MODE=check ;;
  --force) MODE=force ;;
  *) echo "usage: $0 [--check|--force]" >&2; exit 2 ;;
esac

log() { echo "setup-k8s: $*" >&2; }

# Version of module $2 required in go.mod $1 (replace lines have "=>" in field 2).
modver() {
  local v
  v=$(awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) { for (i = 2; i <= NF; i++) if ($i ~ /^v[0-9]/) { print $i; exit } }' "$1")
  [ -n "$v" ] || { log "no version for $2 in $1"; exit 1; }
  echo "$v"
}

# tools/k8s: the control plane, kubectl, etcd and helm; tools/k8s/kwok: kwok (own module).
K8S_VERSION=$(modver "$MOD/go.mod" k8s.io/kubernetes)
HELM_VERSION=$(modver "$MOD/go.mod" helm.sh/helm/v3)
ETCD_VERSION=$(modver "$MOD/go.mod" go.etcd.io/etcd/server/v3)
KWOK_VERSION=$(modver "$MOD/kwok/go.mod" sigs.k8s.io/kwok)
PREFIX=$K8S_CACHE/$K8S_VERSION
BIN=$PREFIX/bin
TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd etcdctl kwok helm)

want=$(cat "$MOD/go.mod" "$MOD/go.sum" "$MOD/kwok/go.mod" "$MOD/kwok/go.sum" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
stamp=$PREFIX/.stamp

up_to_date() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || return 1
  local t
  for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

if [ "$MODE" != force ] && up_to_date; then
  echo "$BIN"
  exit 0
fi
if [ "$MODE" = check ]; then
  log "$BIN is missing or stale: run scripts/setup-k8s.sh"
  exit 3
fi

mkdir -p "$PREFIX"
exec 9>"$K8S_CACHE/.lock"
if ! flock -n 9; then
  log "another setup-k8s.sh is building; waiting for it"
  flock 9
fi
# The other run may have finished the same build while we waited.
if [ "$MODE" != force ] && up_to_date; then
  echo "$BIN"
  exit 0
fi

GO=${GO:-}
if [ -z "$GO" ]; then
  for c in go /usr/local/go/bin/go "$HOME/go/bin/go" /usr/lib/go/bin/go; do
    if command -v "$c" >/dev/null 2>&1; then GO=$(command -v "$c"); break; fi
  done
fi
[ -n "$GO" ] || { log "no Go toolchain found (need Go >= 1.24; set GO=/path/to/go)"; exit 1; }
gover=$(GOTOOLCHAIN=local "$GO" env GOVERSION)
case "$gover" in
  go1.2[4-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
  *) log "$GO is $gover; need Go >= 1.24 (go.mod 'tool' directives)"; exit 1 ;;
esac

export GOTOOLCHAIN=local CGO_ENABLED=0
export GOMODCACHE=$K8S_CACHE/go/mod GOCACHE=$K8S_CACHE/go/build GOPATH=$K8S_CACHE/go/path
# -mod=readonly: go.mod/go.sum in the repo are the pin; a build never edits them.
export GOFLAGS="-mod=readonly -buildvcs=false"
mkdir -p "$GOMODCACHE" "$GOCACHE" "$BIN"

log "Kubernetes $K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION ($gover)"
log "caches under $K8S_CACHE/go, binaries into $BIN"

t0=$(date +%s)
log "downloading modules (first run: ~1 GB from the module proxy)"
(cd "$MOD" && nice -n 15 "$GO" mod download && cd kwok && nice -n 15 "$GO" mod download) >&2

# Version stamping: module zips do not carry the git-archive substitutions, so without
# these a binary reports v0.0.0-master (helm charts with kubeVersion constraints break).
major=${K8S_VERSION#v}; major=${major%%.*}
minor=${K8S_VERSION#v*.}; minor=${minor%%.*}
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
k8s_ldf=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldf+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
  k8s_ldf+=" -X $p.gitTreeState=clean -X $p.gitCommit= -X $p.buildDate=$now"
done
helm_ldf="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
helm_ldf+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
# Offline 'helm template/lint' assume this Kubernetes version instead of v1.20.
for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldf+=" -X $p.k8sVersionMajor=$major -X $p.k8sVersionMinor=$minor"
done
etcd_ldf="-X go.etcd.io/etcd/api/v3/version.GitSHA=module-$ETCD_VERSION"
kwok_ldf="-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"

build() {  # name package extra-ldflags [module dir]
  local name=$1 pkg=$2 ldf=$3 dir=${4:-$MOD} t=$SECONDS
  log "building $name ($pkg)"
  (cd "$dir" && nice -n 15 "$GO" build -trimpath -ldflags "-s -w $ldf" -o "$BIN/.$name.tmp" "$pkg") >&2
  mv -f "$BIN/.$name.tmp" "$BIN/$name"
  log "  $name: $((SECONDS - t)) s, $(du -h "$BIN/$name" | cut -f1)"
}

rm -f "$stamp"
build etcd go.etcd.io/etcd/server/v3 "$etcd_ldf"
build etcdctl go.etcd.io/etcd/etcdctl/v3 "$etcd_ldf"
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$k8s_ldf"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$k8s_ldf"
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$k8s_ldf"
build kubectl k8s.io/kubernetes/cmd/kubectl "$k8s_ldf"
build kwok sigs.k8s.io/kwok/cmd/kwok "$kwok_ldf" "$MOD/kwok"
build helm helm.sh/helm/v3/cmd/helm "$helm_ldf"

got=$("$BIN/kube-apiserver" --version 2>&1)
[ "$got" = "Kubernetes $K8S_VERSION" ] || { log "version stamp failed: '$got'"; exit 1; }
echo "$want" >"$stamp"
log "done in $(($(date +%s) - t0)) s; bin $(du -sh "$BIN" | cut -f1)," \
  "module cache $(du -sh "$GOMODCACHE" | cut -f1), build cache $(du -sh "$GOCACHE" | cut -f1)"
if [ "${KVPLANE_K8S_PRUNE:-0}" = 1 ]; then
  log "KVPLANE_K8S_PRUNE=1: removing $K8S_CACHE/go (a later rebuild starts from scratch)"
  chmod -R u+w "$K8S_CACHE/go" && rm -rf "$K8S_CACHE/go"
fi
echo "$BIN"
