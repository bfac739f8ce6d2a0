#!/usr/bin/env bash
# Builds the lab's Kubernetes binaries 1.20.2 (control plane: kube-apiserver,
# kube-controller-manager, kube-scheduler; node: kubelet, kube-proxy) from Debian
# 12's `kubernetes` source package with Debian's golang-1.19-go, and caches them by
# version outside the checkout:
#
#   $KVPN_CACHE/kubernetes/1.20.2/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kube-proxy,kubectl}
#
# (KVPN_CACHE defaults to /var/cache/kvpn.) A second run finds the binaries and
# exits in seconds. The build (about 9 minutes on 2 cores, 1.3 GB of scratch
# space) happens in a work dir under the cache; the binaries are moved into
# place only when complete, so an interrupted run leaves nothing half-built.
# Facts behind each step: shared/TOOLCHAIN.md, "A real Kubernetes API server".
#
# kubectl: /usr/bin/kubectl when the machine has one, else Debian's
# kubernetes-client unpacked with dpkg-deb -x (it conflicts with an installed
# kubectl, so it is never installed). KVPN_KUBECTL_FROM_DEBIAN=1 forces the
# Debian one.
#
# Run as root (apt-get). Called by scripts/setup.sh and by CI.
set -euo pipefail

K8S_VERSION="1.20.2"
KVPN_CACHE="${KVPN_CACHE:-/var/cache/kvpn}"
K8S_CACHE="$KVPN_CACHE/kubernetes"
OUT="$K8S_CACHE/$K8S_VERSION/bin"
WORK="$K8S_CACHE/$K8S_VERSION/work"
# Go's build cache is content-addressed, so a half-finished build may leave it
# behind safely: a rerun after a failure reuses it. Deleted after success.
GOCACHE_DIR="$K8S_CACHE/gocache"
GO_ROOT="/usr/lib/go-1.19"
SRC_LIST="/etc/apt/sources.list.d/kvpn-deb-src.sources"
SYSTEM_LIST="/etc/apt/sources.list.d/debian.sources"

step() { printf '\033[1m==> [build-kubernetes] %s\033[0m\n' "$*"; }
die() { printf 'build-kubernetes.sh: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" != 0 ]; then
    die "must run as root (it runs apt-get and writes $K8S_CACHE) — rerun with sudo"
fi

mkdir -p "$K8S_CACHE"
# One build at a time (setup.sh and CI may overlap on one machine).
exec 9>"$K8S_CACHE/.lock"
if ! flock -n 9; then
    step "another build-kubernetes.sh holds $K8S_CACHE/.lock; waiting for it"
    flock 9
fi
# Scratch dirs of an interrupted kubectl unpack.
rm -rf "$K8S_CACHE"/kubectl.??????

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_update() {
    if [ "$apt_updated" = 0 ]; then
        apt-get update -qq
        apt_updated=1
    fi
}

# Prints 0 when $1 is a kube binary of our version.
is_ours() {
    [ -x "$1" ] && "$1" --version 2>/dev/null | grep -q "v$K8S_VERSION\b"
}

# --- kubectl -----------------------------------------------------------------
provide_kubectl() {
    local dest="$1"
    # Debian's kubectl 1.20 (same version as the apiserver) is always unpacked into
    # debian-kubectl/ next to bin/, so tests can drive the lab with both it and the
    # machine's own kubectl (e.g. SPDY port-forward from kubectl 1.20).
    local debian_dir
    debian_dir="$(dirname "$dest")/debian-kubectl"
    if ! [ -x "$debian_dir/kubectl" ]; then
        step "unpacking Debian's kubernetes-client (dpkg-deb -x, not installed)"
        local tmp
        tmp="$(mktemp -d "$K8S_CACHE/kubectl.XXXXXX")"
        # apt-get download drops privileges to _apt; let it write here.
        chmod 0777 "$tmp"
        apt_update
        (cd "$tmp" && apt-get download -qq kubernetes-client)
        dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$tmp/root"
        mkdir -p "$debian_dir"
        install -m 0755 "$tmp/root/usr/bin/kubectl" "$debian_dir/kubectl.tmp"
        mv -f "$debian_dir/kubectl.tmp" "$debian_dir/kubectl"
        rm -rf "$tmp"
    fi
    if [ "${KVPN_KUBECTL_FROM_DEBIAN:-0}" != 1 ] && [ -x /usr/bin/kubectl ]; then
        ln -sfn /usr/bin/kubectl "$dest/kubectl"
    else
        ln -sfn "$debian_dir/kubectl" "$dest/kubectl"
    fi
}

# --- cached? -------------------------------------------------------------------
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
all_ours() {
    local b
    for b in "${BINARIES[@]}"; do is_ours "$1/$b" || return 1; done
}
if all_ours "$OUT"; then
    provide_kubectl "$OUT"
    step "Kubernetes $K8S_VERSION binaries cached in $OUT"
    exit 0
fi

start=$(date +%s)
step "building ${BINARIES[*]} $K8S_VERSION (about 9 minutes; log: $K8S_CACHE/$K8S_VERSION/build.log)"

# --- packages ------------------------------------------------------------------
need=()
for p in golang-1.19-go rsync dpkg-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
    step "installing ${need[*]}"
    apt_update
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x "$GO_ROOT/bin/go" ] || die "$GO_ROOT/bin/go missing after installing golang-1.19-go"

# --- source packages, derived from the machine's own apt source ------------------
# A copy of the system's deb822 file with `Types: deb-src`, so the mirror is the
# one this machine already uses (no host name lives in the repository).
if [ ! -f "$SRC_LIST" ]; then
    [ -f "$SYSTEM_LIST" ] || die "$SYSTEM_LIST not found: cannot derive deb-src entries (expects Debian 12's deb822 apt source)"
    step "enabling Debian source packages in $SRC_LIST (derived from $SYSTEM_LIST)"
    sed -e 's/^Types:.*$/Types: deb-src/' "$SYSTEM_LIST" >"$SRC_LIST.tmp"
    mv -f "$SRC_LIST.tmp" "$SRC_LIST"
    apt_updated=0
fi
if ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Package: kubernetes'; then
    apt_updated=0
    apt_update
fi

# --- fresh work dir ----------------------------------------------------------------
# Whatever a previous, interrupted run left here is discarded.
rm -rf "$WORK" "$OUT.tmp"
mkdir -p "$WORK" "$GOCACHE_DIR"
chmod 0777 "$WORK" # apt-get source/download drop privileges to _apt

step "fetching and unpacking the kubernetes source package"
(cd "$WORK" && apt-get source -qq kubernetes >"$WORK/apt-source.log" 2>&1) ||
    { tail -n 20 "$WORK/apt-source.log" >&2; die "apt-get source kubernetes failed"; }
src="$(find "$WORK" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)"
[ -n "$src" ] && [ -f "$src/Makefile" ] || die "no unpacked kubernetes tree in $WORK"
grep -q "gitVersion.*v$K8S_VERSION\|$K8S_VERSION" "$src/debian/changelog" ||
    die "the source package in $src is not Kubernetes $K8S_VERSION (see $src/debian/changelog)"

# The vendored reflect2 1.0.1 breaks at run time with Go >= 1.18; Debian's 1.0.2
# has the fix. Unpacked, not installed.
step "replacing vendored github.com/modern-go/reflect2 with Debian's 1.0.2"
(cd "$WORK" && apt-get download -qq golang-github-modern-go-reflect2-dev)
dpkg-deb -x "$WORK"/golang-github-modern-go-reflect2-dev_*.deb "$WORK/reflect2"
r2="$WORK/reflect2/usr/share/gocode/src/github.com/modern-go/reflect2"
[ -f "$r2/reflect2.go" ] || die "golang-github-modern-go-reflect2-dev has no $r2/reflect2.go"
rm -rf "$src/vendor/github.com/modern-go/reflect2"
mkdir -p "$src/vendor/github.com/modern-go/reflect2"
# Only the package's Go sources (the Debian tree also has tests, docs).
find "$r2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' -o -name 'LICENSE' \) ! -name '*_test.go' \
    -exec cp {} "$src/vendor/github.com/modern-go/reflect2/" \;

# --- make ----------------------------------------------------------------------------
what="$(printf 'cmd/%s ' "${BINARIES[@]}")"
what="${what% }"
step "make WHAT=\"$what\" with Go $("$GO_ROOT/bin/go" env GOVERSION)"
log="$K8S_CACHE/$K8S_VERSION/build.log"
(
    cd "$src"
    export PATH="$GO_ROOT/bin:$PATH"
    export GOCACHE="$GOCACHE_DIR"
    export GOPATH="$WORK/gopath"
    # Kubernetes 1.20's build sets up its own GOPATH under _output and builds
    # from vendor/; GOFLAGS would end up among its build tags, so keep it empty.
    unset GOFLAGS
    export GOTOOLCHAIN=local
    # Not a git checkout: give the build its version explicitly.
    export KUBE_GIT_VERSION="v$K8S_VERSION"
    export KUBE_GIT_TREE_STATE="clean"
    export KUBE_GIT_MAJOR="${K8S_VERSION%%.*}"
    minor="${K8S_VERSION#*.}"
    export KUBE_GIT_MINOR="${minor%%.*}"
    nice -n 10 make WHAT="$what"
) >"$log" 2>&1 &
make_pid=$!
# Progress: the build's own step lines as they come, and a heartbeat each minute
# (the last step, compiling the two commands, is quiet for several minutes).
shown=0
beat=$(date +%s)
while kill -0 "$make_pid" 2>/dev/null; do
    sleep 2
    lines=$(wc -l <"$log")
    if [ "$lines" -gt "$shown" ]; then
        sed -n "$((shown + 1)),${lines}p" "$log" | grep -E '^\+\+\+|^    [a-z./]|^!!!' || true
        shown=$lines
    fi
    if [ $(($(date +%s) - beat)) -ge 60 ]; then
        beat=$(date +%s)
        step "still compiling ($((beat - start)) s so far)"
    fi
done
if ! wait "$make_pid"; then
    tail -n 40 "$log" >&2
    die "make failed (full log: $log; work dir kept: $WORK)"
fi

# --- install into the cache --------------------------------------------------------------
built="$src/_output/bin"
[ -d "$built" ] || built="$src/_output/local/bin/linux/amd64"
mkdir -p "$OUT.tmp"
for b in "${BINARIES[@]}"; do
    [ -x "$built/$b" ] || die "make finished but $built/$b is missing (log: $log)"
    install -m 0755 "$built/$b" "$OUT.tmp/$b"
    is_ours "$OUT.tmp/$b" || die "$OUT.tmp/$b --version does not report v$K8S_VERSION"
done
provide_kubectl "$OUT.tmp"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
rm -rf "$WORK" "$GOCACHE_DIR"

step "built Kubernetes $K8S_VERSION in $(($(date +%s) - start)) s: $OUT"
"$OUT/kube-apiserver" --version
