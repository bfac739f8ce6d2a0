#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine for building, running and
# testing kvpn. Run as root. Everything slow is cached outside the checkout
# under $KVPN_CACHE (default /var/cache/kvpn) and reused when present.
set -euo pipefail

KVPN_CACHE="${KVPN_CACHE:-/var/cache/kvpn}"
TOOLS="$KVPN_CACHE/tools"
mkdir -p "$KVPN_CACHE" "$TOOLS/bin"
here="$(cd "$(dirname "$0")/.." && pwd)"

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
    echo "setup.sh: must run as root (it installs apt packages and builds the lab) — rerun with sudo" >&2
    exit 1
fi

# --- apt packages ---------------------------------------------------------
APT_PACKAGES=(
    iproute2 nftables iperf3 curl dnsutils iputils-ping procps psmisc bc
    protobuf-compiler bpftool socat tcpdump sudo
    dnsmasq-base dnsperf musl-tools
    etcd-server golang-1.19-go rsync
    openssh-server openssh-client openssl
    sshuttle iptables
    # GSSAPI/Kerberos SSH login: the build (libgssapi-sys runs bindgen on the MIT
    # headers: libclang and its builtin headers) and the lab's KDC, kadmin.local, kinit
    libkrb5-dev libclang1-14 libclang-common-14-dev pkg-config
    krb5-kdc krb5-admin-server krb5-user
    # Container images and real node software: umoci builds the OCI images
    # (`./x image`), skopeo copies them to registries, containerd + runc + the CNI
    # plugins run them; busybox-static gives the lab's images a shell and tools.
    umoci skopeo containerd runc containernetworking-plugins busybox-static
    # a registry on loopback for the image tests (skopeo push and pull); podman
    # loads the archive and buildah builds images/Containerfile (tests/tests/image.rs)
    docker-registry podman buildah
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "installing apt packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # etcd-server's package starts a system etcd on :2379; the lab runs its own.
    systemctl disable --now etcd >/dev/null 2>&1 || true
    # Likewise the Kerberos packages' system KDC and kadmind: the lab runs its own.
    systemctl disable --now krb5-kdc krb5-admin-server >/dev/null 2>&1 || true
    # containerd's package starts a system containerd; each lab node runs its own.
    systemctl disable --now containerd docker-registry >/dev/null 2>&1 || true
    # Without systemd the package's init script may have started it.
    [ -x /etc/init.d/docker-registry ] && /etc/init.d/docker-registry stop >/dev/null 2>&1 || true
fi

# --- systemd-resolved, for the dns-04 test only ----------------------------
# The test runs its own systemd-resolved and dbus-daemon inside a laptop netns
# and a private mount namespace; this machine's DNS must not change. The
# packages' maintainer scripts would: turn /etc/resolv.conf into a symlink to
# resolved's stub (systemd-resolved), add `resolve` to the hosts line of
# /etc/nsswitch.conf (libnss-resolve), and enable (on a systemd host: start)
# the service. So both files are saved first and put back byte for byte, and the
# service is disabled. The saved copies live in the cache until restored, so a
# run interrupted mid-install is repaired by the next run.
RESOLVED_PACKAGES=(systemd-resolved libnss-resolve)
saved="$KVPN_CACHE/pre-resolved"
restore_dns_files() {
    [ -d "$saved" ] || return 0
    for f in resolv.conf nsswitch.conf; do
        [ -e "$saved/$f" ] || [ -L "$saved/$f" ] || continue
        if ! { [ -L "$saved/$f" ] && [ "$(readlink "$saved/$f")" = "$(readlink "/etc/$f" 2>/dev/null)" ]; } &&
            ! { [ ! -L "$saved/$f" ] && [ ! -L "/etc/$f" ] && cmp -s "$saved/$f" "/etc/$f"; }; then
            step "restoring /etc/$f as it was before systemd-resolved was installed"
            # cp over the file (not rename) also works where /etc/resolv.conf is a bind mount.
            if [ -L "$saved/$f" ] || [ -L "/etc/$f" ]; then
                rm -f "/etc/$f" && cp -a "$saved/$f" "/etc/$f"
            else
                cat "$saved/$f" >"/etc/$f"
            fi
        fi
    done
    # systemd-resolved's postinst keeps the replaced file here.
    if [ -e /etc/.resolv.conf.systemd-resolved.bak ] && cmp -s /etc/.resolv.conf.systemd-resolved.bak /etc/resolv.conf; then
        rm -f /etc/.resolv.conf.systemd-resolved.bak
    fi
    rm -rf "$saved"
}
restore_dns_files
missing=()
for p in "${RESOLVED_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    # The version of the installed systemd when the archive has it (the packages
    # require an exact match; otherwise apt would upgrade systemd too).
    sysv="$(dpkg-query -W -f='${Version}' systemd 2>/dev/null || true)"
    want=("${missing[@]}")
    apt-get update -qq
    if [ -n "$sysv" ] && apt-cache madison systemd-resolved | grep -F "| $sysv |" >/dev/null; then
        want=("${missing[@]/%/=$sysv}")
    fi
    step "installing ${want[*]} (not enabled; /etc/resolv.conf and /etc/nsswitch.conf kept)"
    mkdir -p "$saved"
    cp -a /etc/resolv.conf "$saved/resolv.conf"
    cp -a /etc/nsswitch.conf "$saved/nsswitch.conf"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
    systemctl disable --now systemd-resolved >/dev/null 2>&1 || true
    restore_dns_files
fi

# --- Rust toolchains -------------------------------------------------------
if ! rustup toolchain list | grep -q '^nightly'; then
    step "installing the nightly toolchain (for the eBPF build)"
    rustup toolchain install nightly --profile minimal
fi
if ! rustup component list --toolchain nightly --installed | grep -q '^rust-src'; then
    step "adding rust-src to nightly"
    rustup component add rust-src --toolchain nightly
fi

# --- musl target, for the static kvpn-manager in the image ---------------------
if ! rustup target list --installed | grep -q '^x86_64-unknown-linux-musl$'; then
    step "adding the x86_64-unknown-linux-musl target (static manager image)"
    rustup target add x86_64-unknown-linux-musl
fi

# --- bpf-linker against the toolchain's own LLVM (TOOLCHAIN.md) -------------
if ! "$TOOLS/bin/bpf-linker" --version >/dev/null 2>&1; then
    step "building bpf-linker 0.13.0 against nightly's LLVM (about a minute)"
    sysroot="$(rustup run nightly rustc --print sysroot)"
    llvm_so="$(ls "$sysroot"/lib/libLLVM.so.*-rust-* 2>/dev/null | head -n1 || true)"
    [ -n "$llvm_so" ] || { echo "setup.sh: no libLLVM in $sysroot/lib — reinstall the nightly toolchain" >&2; exit 1; }
    major="$(basename "$llvm_so" | sed -E 's/^libLLVM\.so\.([0-9]+).*/\1/')"
    prefix="$KVPN_CACHE/llvm-$major"
    mkdir -p "$prefix/lib"
    # Copy, do not link: `rustup update` deletes the original.
    cp -f "$llvm_so" "$prefix/lib/"
    ln -sf "$(basename "$llvm_so")" "$prefix/lib/libLLVM.so"
    LLVM_PREFIX="$prefix" cargo install --root "$TOOLS" bpf-linker --version 0.13.0 --locked \
        --no-default-features --features "llvm-$major"
fi

# --- Kubernetes control-plane binaries (lab) -------------------------------
if [ -x "$here/scripts/build-kubernetes.sh" ]; then
    "$here/scripts/build-kubernetes.sh"
fi

step "set-up done (cache: $KVPN_CACHE)"
