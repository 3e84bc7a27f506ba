#!/bin/bash
# Idempotent set-up of a fresh Debian 12 (bookworm) machine for spice-observer:
# build (eBPF toolchain) and tests (the SPICE rig in rig/).  Run as root:
#
#   scripts/setup.sh               # everything
#   scripts/setup.sh --no-qemu     # everything but the private QEMU for the QEMU test
#   scripts/setup.sh --with-viewer # also virt-viewer + spice-client-gtk (optional
#                                  # GUI clients for rig experiments; ~28 packages, GTK3)
#
# Steps (each one checks first and does nothing when its part is present, so a
# second run takes a couple of seconds; `apt-get update` runs only when a
# package must be installed):
#   1. Debian packages: LLVM 22 dev files (llvm-22-dev libpolly-22-dev, from
#      bookworm-security), zlib1g-dev libzstd-dev, bpftool, iproute2, ethtool,
#      iputils-ping, and the rig's packages (Xspice, python3-xlib, spice-gtk GI
#      bindings, Xvfb, socat, haproxy, tshark, iperf3, busybox-static, cpio,
#      sysstat, bc, stunnel4, openssl, ...)
#   2. rustup (if missing) and the pinned toolchain nightly-2026-05-19
#      (LLVM 22.1.4) with rust-src
#   3. bpf-linker built against the system LLVM 22 (~/.cargo/bin/bpf-linker)
#   4. QEMU 7.2 in a private prefix + guest kernel + initramfs
#      (rig/start-qemu.sh prepare; cache $RIG_QEMU_CACHE, default /var/tmp/rig-qemu)
#   5. tracefs mounted on /sys/kernel/tracing, the BPF filesystem on /sys/fs/bpf
#      (the daemon pins its kernel state under /sys/fs/bpf/spice-observer)
# One line per step; details of installs go to $SETUP_LOG (default
# /tmp/spice-observer-setup.log).  Exit status non-zero, with the reason and
# the log's tail, if any step fails.
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
TOOLCHAIN=nightly-2026-05-19
TOOLCHAIN_LLVM=22
LLVM_PREFIX=/usr/lib/llvm-22
BPF_LINKER_VERSION=${BPF_LINKER_VERSION:-0.13.0}   # has the llvm-22 feature
LOG=${SETUP_LOG:-/tmp/spice-observer-setup.log}

APT_PKGS=(
    # eBPF build: bpf-linker links against LLVM 22 (= the pinned nightly's LLVM)
    llvm-22-dev libpolly-22-dev zlib1g-dev libzstd-dev
    # runtime / tests
    bpftool iproute2 ethtool iputils-ping
    # rig: Xspice server + X animation, headless spice-gtk client, Xvfb
    xserver-xspice python3-xlib x11-apps python3-gi gir1.2-spiceclientglib-2.0
    xvfb x11-utils
    # rig: relay, oracle, link tests, QEMU guest initramfs, measurements
    socat haproxy tshark iperf3 busybox-static cpio sysstat bc
    # rig/stunnel.sh, rig/tls-certs.sh, tests/tls.rs: a TLS-terminating relay (stunnel 5.68,
    # dynamically linked libssl.so.3) and throwaway certificates
    stunnel4 openssl
    # tests/daemon.rs: `promtool check metrics` on live scrapes (promtool ships in prometheus)
    prometheus
    # tests/service.rs: `systemd-analyze verify` of packaging/spice-observer.service
    # (minimal Debian images, e.g. containers, lack systemd); setpriv is util-linux (essential)
    systemd
    # used by this script and the rig
    ca-certificates curl gzip procps
)
VIEWER_PKGS=(virt-viewer spice-client-gtk)

with_qemu=1
for a in "$@"; do
    case "$a" in
    --no-qemu) with_qemu=0;;
    --with-viewer) APT_PKGS+=("${VIEWER_PKGS[@]}");;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;;
    *) echo "setup.sh: unknown option '$a' (try --help)" >&2; exit 2;;
    esac
done

if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: must run as root (it installs Debian packages, writes /var/tmp/rig-qemu" >&2
    echo "          and mounts tracefs).  Run it as root, e.g.: sudo $0 $*" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
export RUSTUP_AUTO_INSTALL=0          # checks below must never install by accident
CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}
export PATH="$CARGO_HOME/bin:$PATH"
: >"$LOG"
T0=$SECONDS
n_step=0
step_t0=0

begin() { n_step=$((n_step + 1)); step_t0=$SECONDS; printf 'setup [%d/6] %-34s ' "$n_step" "$1"; }
ok() { echo "ok (already present${1:+, $1})"; }
done_() { echo "installed in $((SECONDS - step_t0)) s${1:+ ($1)}"; }
skip() { echo "skipped ($1)"; }
fail() {
    echo "FAILED"
    echo "setup.sh: $*" >&2
    if [[ -s $LOG ]]; then echo "--- last lines of $LOG:" >&2; tail -25 "$LOG" >&2; fi
    exit 1
}
logrun() { echo "+ $*" >>"$LOG"; "$@" >>"$LOG" 2>&1; }

apt_updated=0
apt_update_once() {
    [[ $apt_updated == 1 ]] && return 0
    logrun apt-get update || fail "apt-get update failed"
    apt_updated=1
}

# --- 1. Debian packages ---------------------------------------------------------
missing_pkgs() {  # prints the packages of "$@" that are not installed
    local installed
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$@" 2>/dev/null |
                awk '$2 == "ii" {print $1}' || true)
    local p
    for p in "$@"; do grep -qxF "$p" <<<"$installed" || echo "$p"; done
}

begin "debian packages (${#APT_PKGS[@]})"
mapfile -t miss < <(missing_pkgs "${APT_PKGS[@]}")
if [[ ${#miss[@]} -eq 0 ]]; then
    ok
else
    echo -n "[missing: ${miss[*]}] "
    apt_update_once
    for p in "${miss[@]}"; do
        cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
        if [[ -z $cand || $cand == "(none)" ]]; then
            case "$p" in
            llvm-22-*|libpolly-22-*)
                fail "$p has no install candidate: LLVM 22 comes from bookworm-security here;" \
                     "check that /etc/apt/sources.list(.d) has 'deb http://deb.debian.org/debian-security" \
                     "bookworm-security main' and see 'apt-cache policy llvm-22-dev'";;
            *) fail "package $p has no install candidate (apt-cache policy $p)";;
            esac
        fi
    done
    logrun apt-get install -y --no-install-recommends "${miss[@]}" ||
        fail "apt-get install ${miss[*]} failed"
    mapfile -t still < <(missing_pkgs "${miss[@]}")
    [[ ${#still[@]} -eq 0 ]] || fail "still not installed after apt-get install: ${still[*]}"
    done_ "${#miss[@]} packages"
fi

# --- 2. Rust toolchain ---------------------------------------------------------------
toolchain_ok() {
    rustup toolchain list 2>/dev/null | grep -q "^$TOOLCHAIN" || return 1
    local vv sysroot
    vv=$(rustup run "$TOOLCHAIN" rustc -vV 2>/dev/null) || return 1
    grep -q "^LLVM version: $TOOLCHAIN_LLVM\." <<<"$vv" || return 1
    sysroot=$(rustup run "$TOOLCHAIN" rustc --print sysroot 2>/dev/null) || return 1
    [[ -f $sysroot/lib/rustlib/src/rust/library/core/src/lib.rs ]]   # rust-src
}

begin "rust $TOOLCHAIN + rust-src"
if command -v rustup >/dev/null && toolchain_ok; then
    ok "$(rustup run "$TOOLCHAIN" rustc -vV | awk '/^LLVM version/ {print "LLVM " $3}')"
else
    if ! command -v rustup >/dev/null; then
        # sh.rustup.rs is not reachable from here; the rustup-init binary is
        init=$(mktemp -d)/rustup-init
        logrun curl -sSf --retry 3 -o "$init" \
            https://static.rust-lang.org/rustup/dist/x86_64-unknown-linux-gnu/rustup-init ||
            fail "could not download rustup-init"
        chmod +x "$init"
        logrun "$init" -y --profile minimal --default-toolchain none --no-modify-path ||
            fail "rustup-init failed"
        rm -rf "$(dirname "$init")"
        command -v rustup >/dev/null || fail "rustup not on PATH after install ($CARGO_HOME/bin)"
    fi
    logrun rustup toolchain install "$TOOLCHAIN" --profile minimal -c rust-src ||
        fail "rustup toolchain install $TOOLCHAIN failed"
    toolchain_ok || fail "$TOOLCHAIN installed but rustc -vV / LLVM $TOOLCHAIN_LLVM / rust-src check fails"
    done_
fi

# --- 3. bpf-linker ----------------------------------------------------------------------
bpf_linker_ok() {
    local bl libs
    bl=$(command -v bpf-linker) || return 1
    bpf-linker --version >/dev/null 2>&1 || return 1
    libs=$(ldd "$bl" 2>/dev/null) || return 1
    grep -q 'not found' <<<"$libs" && return 1
    # dynamically linked against some libLLVM: it must be LLVM 22
    if grep -q 'libLLVM' <<<"$libs"; then grep -q 'libLLVM\.so\.22' <<<"$libs" || return 1; fi
    return 0
}

begin "bpf-linker (LLVM 22)"
if bpf_linker_ok; then
    ok "$(bpf-linker --version 2>/dev/null | head -1)"
else
    [[ -x $LLVM_PREFIX/bin/llvm-config ]] || fail "$LLVM_PREFIX/bin/llvm-config missing (llvm-22-dev)"
    # default toolchain's cargo if it works (bpf-linker builds with stable),
    # else the pinned nightly's
    cargo=(cargo)
    cargo --version >/dev/null 2>&1 || cargo=(rustup run "$TOOLCHAIN" cargo)
    # LLVM_PREFIX: /usr/bin/llvm-config is LLVM 14 here; bpf-linker's default
    # feature targets LLVM 23, hence --no-default-features --features llvm-22
    LLVM_PREFIX=$LLVM_PREFIX logrun "${cargo[@]}" install bpf-linker --version "$BPF_LINKER_VERSION" \
        --locked --force --no-default-features --features llvm-22 ||
        fail "cargo install bpf-linker failed"
    hash -r
    bpf_linker_ok || fail "bpf-linker installed but 'bpf-linker --version' / its LLVM 22 linkage check fails"
    done_ "$(bpf-linker --version | head -1)"
fi

# --- 4. QEMU for the QEMU test ------------------------------------------------------------
begin "qemu (rig/start-qemu.sh prepare)"
if [[ $with_qemu == 0 ]]; then
    skip "--no-qemu"
elif "$ROOT/rig/start-qemu.sh" check >/dev/null 2>&1; then
    ok "${RIG_QEMU_CACHE:-/var/tmp/rig-qemu}"
else
    apt_update_once   # prepare installs and downloads packages
    logrun "$ROOT/rig/start-qemu.sh" prepare || fail "rig/start-qemu.sh prepare failed"
    "$ROOT/rig/start-qemu.sh" check >>"$LOG" 2>&1 || fail "rig/start-qemu.sh check fails after prepare"
    done_
fi

# --- 5. tracefs -------------------------------------------------------------------------------
begin "tracefs on /sys/kernel/tracing"
if mountpoint -q /sys/kernel/tracing; then
    ok
else
    logrun mount -t tracefs nodev /sys/kernel/tracing || fail "mount -t tracefs nodev /sys/kernel/tracing failed"
    echo "mounted"
fi

begin "bpffs on /sys/fs/bpf"
if [[ $(stat -f -c %T /sys/fs/bpf 2>/dev/null) == bpf_fs ]]; then
    ok
else
    logrun mount -t bpf bpf /sys/fs/bpf || fail "mount -t bpf bpf /sys/fs/bpf failed"
    echo "mounted"
fi

echo "setup: all done in $((SECONDS - T0)) s"
