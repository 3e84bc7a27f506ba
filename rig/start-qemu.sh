#!/bin/bash
# spice-server inside QEMU 7.2 (Debian bookworm qemu-system-x86 1:7.2+dfsg-7),
# guest = Debian's linux-image-6.1 kernel + a busybox-static initramfs whose
# /init scribbles on /dev/fb0 (VESA framebuffer, vga=0x314 800x600x16).
#
#   rig/start-qemu.sh prepare     # once: fetch/extract qemu + kernel, build initrd
#                                 # (skips what is already there; safe to repeat)
#   rig/start-qemu.sh check       # exit 0 iff prepare has nothing left to do
#   rig/start-qemu.sh start [PORT] [MODE] [FPS] [ROWS] [FRAMES]
#   rig/start-qemu.sh wait-done [PORT] [TIMEOUT_S]  # until the guest drew FRAMES
#   rig/start-qemu.sh stop  [PORT]
#   rig/start-qemu.sh status [PORT]
#     PORT   spice port on 127.0.0.1 (default 5906)
#     MODE   noise  : ROWS full-width rows of /dev/urandom at a moving offset (default)
#            pattern: ROWS rows from a random 1 MiB block made once at boot (cheap
#                     for the TCG CPU, still incompressible)
#     FPS    frames per second the guest tries (default 20; busybox usleep pacing,
#            under TCG the real rate can be lower)
#     ROWS   rows per frame (default 192 of 600; 800x600x2 B = 1600 B per row)
#     FRAMES stop drawing after this many frames, 0 = forever (default 0, or env
#            RIG_QEMU_FRAMES); the guest then idles and the SPICE session goes quiet
#            (guest kernel parameter rig.frames=N)
# e.g. rig/start-qemu.sh start 5906 noise 20 192
#      rig/start-qemu.sh start 5906 noise 20 192 100; rig/start-qemu.sh wait-done 5906 60
#
# Env: RIG_QEMU_VGA=qxl|std (default qxl), RIG_QEMU_ACCEL=tcg|kvm (default tcg;
#      kvm never booted on this nested host), RIG_QEMU_CACHE (default
#      /var/tmp/rig-qemu) for qemu/kernel/initrd, RIG_RUN (default
#      /tmp/rig-qemu-PORT) for qemu.pid, qemu.log, serial.log.
# `start` returns when the guest prints "rig: animating" on its serial console
# ($RIG_RUN/serial.log; ~5 s of TCG boot); with FRAMES it prints
# "rig: done N frames" there when it stops drawing.  Stale state: `start`
# first stops a QEMU left by an earlier run with the same RIG_RUN (pid file,
# only if the PID is still that qemu); a port held by anything else is an error.
#
# Why qemu is extracted into a private prefix instead of `apt-get install
# qemu-system-x86`: this image ships qemu-utils 1:10.0.2 (bookworm-backports),
# which Breaks qemu-system-common (<< 8.0), so apt refuses bookworm's 7.2.
# `prepare` therefore installs the dependencies of qemu-system-x86 and
# qemu-system-common with apt (none of them conflicts), `apt-get download`s
# those two packages and `dpkg-deb -x`'s them into $CACHE/qemu.  Modules
# (ui-spice-core, hw-display-qxl) are found through QEMU_MODULE_DIR, firmware
# through -L.  If a system /usr/bin/qemu-system-x86_64 exists it is used instead.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
CACHE=${RIG_QEMU_CACHE:-/var/tmp/rig-qemu}
QPKGS=(qemu-system-x86 qemu-system-common)
EXTRA_DEPS=(busybox-static cpio gzip)
QEMU_RE='qemu-system-x86_64 -name rig-spice'
cmd=${1:-}; shift || true
export DEBIAN_FRONTEND=noninteractive

qemu_bin() {
    if [[ -x /usr/bin/qemu-system-x86_64 ]]; then echo /usr/bin/qemu-system-x86_64
    else echo "$CACHE/qemu/usr/bin/qemu-system-x86_64"; fi
}
private() { [[ $(qemu_bin) == "$CACHE"/* ]]; }
qemu_env() {  # environment for running qemu -> array QENV
    QENV=()
    if private; then QENV=("QEMU_MODULE_DIR=$CACHE/qemu/usr/lib/x86_64-linux-gnu/qemu"); fi
}

# the guest's /init; its hash is stored with the initrd, so a changed script
# (or busybox) rebuilds it
init_script() {
    cat <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mode=noise; fps=20; rows=192; frames=0
for a in $(cat /proc/cmdline); do
  case $a in
    rig.mode=*) mode=${a#*=};; rig.fps=*) fps=${a#*=};;
    rig.rows=*) rows=${a#*=};; rig.frames=*) frames=${a#*=};;
  esac
done
exec </dev/ttyS0 >/dev/ttyS0 2>&1
echo 0 > /sys/class/graphics/fbcon/cursor_blink 2>/dev/null
[ -e /dev/fb0 ] || { echo "rig: no /dev/fb0"; ls /sys/class/graphics; while :; do sleep 3600; done; }
set -- $(cat /sys/class/graphics/fb0/virtual_size | tr , ' ')
w=$1; h=$2; bpp=$(cat /sys/class/graphics/fb0/bits_per_pixel)
stride=$(cat /sys/class/graphics/fb0/stride)
echo "rig: fb0 ${w}x${h}x${bpp} stride $stride mode=$mode fps=$fps rows=$rows frames=$frames"
[ "$rows" -gt "$h" ] && rows=$h
[ "$mode" = pattern ] && dd if=/dev/urandom of=/tmp/pat bs=1048576 count=1 2>/dev/null
us=$((1000000 / fps)); y=0; n=0
echo "rig: animating"
while [ "$frames" -eq 0 ] || [ "$n" -lt "$frames" ]; do
  if [ "$mode" = pattern ]; then
    dd if=/tmp/pat of=/dev/fb0 bs=$stride count=$rows skip=$((n % (1048576 / stride - rows))) seek=$y conv=notrunc 2>/dev/null
  else
    dd if=/dev/urandom of=/dev/fb0 bs=$stride count=$rows seek=$y conv=notrunc 2>/dev/null
  fi
  y=$(( (y + 37) % (h - rows) )); n=$((n + 1))
  usleep $us
done
echo "rig: done $n frames"
# init must never exit (kernel panic); nothing draws any more
while :; do sleep 3600; done
EOF
}
initrd_stamp() { { init_script; sha256sum /bin/busybox 2>/dev/null; } | sha256sum | cut -c1-16; }

# dependencies to install with apt: those of the two qemu packages, minus the
# packages themselves (which are only extracted)
qemu_deps() {
    apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "${QPKGS[@]}" 2>/dev/null |
        awk '$1 == "Depends:" && $2 !~ /^</ {print $2}' |
        grep -vxE 'qemu-system-x86|qemu-system-common' | sort -u
}
missing_pkgs() {  # missing_pkgs PKG... -> the ones not installed
    local p
    for p in "$@"; do
        [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) == ii* ]] || echo "$p"
    done
}
apt_retry() {  # run an apt command; on failure refresh the lists once and retry
    "$@" >/dev/null 2>&1 && return 0
    apt-get update -qq >/dev/null 2>&1 || true
    "$@"
}

# check: qemu runs (all libraries and the spice/qxl modules resolve), kernel
# and an initrd built from the current /init are in the cache
check() {
    local q m bad
    q=$(qemu_bin)
    [[ -x $q ]] || { echo "no qemu ($q)"; return 1; }
    [[ -f $CACHE/vmlinuz ]] || { echo "no $CACHE/vmlinuz"; return 1; }
    [[ -f $CACHE/initrd.gz && $(cat "$CACHE/initrd.stamp" 2>/dev/null) == "$(initrd_stamp)" ]] \
        || { echo "initrd missing or outdated"; return 1; }
    [[ -x /bin/busybox ]] || { echo "no /bin/busybox"; return 1; }
    if private; then
        m=$CACHE/qemu/usr/lib/x86_64-linux-gnu/qemu
        [[ -f $m/ui-spice-core.so && -f $m/hw-display-qxl.so ]] || { echo "spice/qxl modules missing"; return 1; }
        bad=$(ldd "$q" "$m/ui-spice-core.so" "$m/hw-display-qxl.so" 2>&1 | grep 'not found' || true)
        [[ -z $bad ]] || { echo "unresolved libraries: $bad"; return 1; }
        [[ -f /usr/share/seabios/bios-256k.bin ]] || { echo "no seabios"; return 1; }
    fi
    qemu_env
    env "${QENV[@]}" "$q" --version >/dev/null 2>&1 || { echo "qemu --version fails"; return 1; }
    return 0
}

prepare() {
    local t0=$SECONDS
    if check >/dev/null; then echo "already prepared: $(qemu_bin), $CACHE/vmlinuz, $CACHE/initrd.gz"; return 0; fi
    mkdir -p "$CACHE"
    if [[ ! -x /usr/bin/qemu-system-x86_64 ]]; then
        local deps miss
        deps=$(qemu_deps)
        if [[ -z $deps ]]; then apt-get update -qq >/dev/null; deps=$(qemu_deps); fi
        [[ -n $deps ]] || rig_die "apt-cache knows no dependencies of ${QPKGS[*]}"
        # shellcheck disable=SC2086
        miss=$(missing_pkgs $deps "${EXTRA_DEPS[@]}" | tr '\n' ' ')
        if [[ -n ${miss// /} ]]; then
            echo "prepare: apt-get install $miss"
            # shellcheck disable=SC2086
            apt_retry apt-get install -y -q --no-install-recommends $miss
        fi
        if [[ ! -x $CACHE/qemu/usr/bin/qemu-system-x86_64 ]]; then
            echo "prepare: extracting ${QPKGS[*]} into $CACHE/qemu"
            rm -rf "$CACHE/qemu" "$CACHE"/qemu-system-*.deb
            # shellcheck disable=SC2086
            (cd "$CACHE" && apt_retry apt-get download "${QPKGS[@]}")
            mkdir -p "$CACHE/qemu.tmp"
            for d in "$CACHE"/qemu-system-*.deb; do dpkg-deb -x "$d" "$CACHE/qemu.tmp"; done
            mv "$CACHE/qemu.tmp" "$CACHE/qemu"
            rm -f "$CACHE"/qemu-system-*.deb
        fi
    else
        local miss; miss=$(missing_pkgs "${EXTRA_DEPS[@]}" | tr '\n' ' ')
        # shellcheck disable=SC2086
        [[ -z ${miss// /} ]] || apt_retry apt-get install -y -q --no-install-recommends $miss
    fi
    if [[ ! -f $CACHE/vmlinuz ]]; then
        local pkg
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
        if [[ -z $pkg ]]; then
            apt-get update -qq >/dev/null
            pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
        fi
        [[ -n $pkg ]] || rig_die "cannot resolve linux-image-amd64"
        echo "prepare: guest kernel from $pkg"
        rm -rf "$CACHE/k" "$CACHE"/linux-image-*.deb
        (cd "$CACHE" && apt_retry apt-get download "$pkg")
        mkdir -p "$CACHE/k"; dpkg-deb -x "$CACHE"/linux-image-*.deb "$CACHE/k"
        cp "$CACHE"/k/boot/vmlinuz-* "$CACHE/vmlinuz.tmp"; mv "$CACHE/vmlinuz.tmp" "$CACHE/vmlinuz"
        rm -rf "$CACHE/k" "$CACHE"/linux-image-*.deb
    fi
    local stamp; stamp=$(initrd_stamp)
    if [[ ! -f $CACHE/initrd.gz || $(cat "$CACHE/initrd.stamp" 2>/dev/null) != "$stamp" ]]; then
        # initramfs: static busybox + /init (no kernel modules needed: the Debian
        # kernel has vesafb built in, and qxl/std VGA both offer VESA modes)
        local R; R=$(mktemp -d)
        mkdir -p "$R"/{bin,dev,proc,sys,tmp}
        cp /bin/busybox "$R/bin/busybox"
        init_script >"$R/init"; chmod +x "$R/init"
        (cd "$R" && find . | cpio -o -H newc --quiet | gzip -1 >"$CACHE/initrd.gz.tmp")
        rm -rf "$R"
        mv "$CACHE/initrd.gz.tmp" "$CACHE/initrd.gz"; echo "$stamp" >"$CACHE/initrd.stamp"
    fi
    local why; why=$(check) || rig_die "prepare finished but check fails: $why"
    qemu_env
    echo "prepared in $((SECONDS - t0)) s: $(qemu_bin) ($(env "${QENV[@]}" "$(qemu_bin)" --version | head -1)), $CACHE/vmlinuz, $CACHE/initrd.gz"
}

run_dir() { echo "${RIG_RUN:-/tmp/rig-qemu-$1}"; }

start() {
    local port=${1:-5906} mode=${2:-noise} fps=${3:-20} rows=${4:-192} frames=${5:-${RIG_QEMU_FRAMES:-0}}
    [[ $port =~ ^[0-9]+$ && $fps =~ ^[0-9]+$ && $rows =~ ^[0-9]+$ && $frames =~ ^[0-9]+$ && $fps -gt 0 ]] \
        || rig_die "bad arguments: PORT FPS ROWS FRAMES must be numbers (FPS > 0)"
    local RUN; RUN=$(run_dir "$port")
    check >/dev/null || { echo "qemu cache incomplete; running prepare" >&2; prepare >&2; }
    mkdir -p "$RUN"
    rig_stop_pidfile "$RUN/qemu.pid" "$QEMU_RE"
    if rig_listening "$port"; then
        echo "port $port is already in use:" >&2; rig_listener_info "$port" >&2; exit 1
    fi
    rm -f "$RUN/serial.log" "$RUN/qemu.log"   # the readiness check greps serial.log
    local q; q=$(qemu_bin)
    local extra=()
    private && extra=(-L /usr/share/seabios -L /usr/share/qemu)  # seabios + qemu-system-data
    local accel=${RIG_QEMU_ACCEL:-tcg} t0=$SECONDS
    qemu_env
    env "${QENV[@]}" setsid "$q" -name rig-spice -machine pc -accel "$accel" -m 256 -smp 1 \
        -nodefaults -no-user-config -display none -vga "${RIG_QEMU_VGA:-qxl}" \
        -spice "port=$port,addr=127.0.0.1,disable-ticketing=on" \
        -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.gz" \
        -append "console=ttyS0 vga=0x314 quiet loglevel=3 rig.mode=$mode rig.fps=$fps rig.rows=$rows rig.frames=$frames" \
        -serial "file:$RUN/serial.log" -monitor none "${extra[@]}" \
        >"$RUN/qemu.log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$RUN/qemu.pid"

    for _ in $(seq 900); do
        grep -q 'rig: animating' "$RUN/serial.log" 2>/dev/null && break
        rig_alive "$pid" || { echo "qemu exited:" >&2; cat "$RUN/qemu.log" >&2; rm -f "$RUN/qemu.pid"; exit 1; }
        sleep 0.1
    done
    if ! grep -q 'rig: animating' "$RUN/serial.log" 2>/dev/null; then
        echo "guest did not start animating in 90 s:" >&2; tail "$RUN/serial.log" >&2 || true
        rig_stop_pidfile "$RUN/qemu.pid" "$QEMU_RE"; exit 1
    fi
    grep 'rig:' "$RUN/serial.log" || true
    echo "qemu ($accel, -vga ${RIG_QEMU_VGA:-qxl}) spice on 127.0.0.1:$port pid $pid, guest animating after $((SECONDS - t0)) s (state $RUN)"
}

wait_done() {
    local port=${1:-5906} timeout=${2:-120} RUN
    RUN=$(run_dir "$port")
    for _ in $(seq $((timeout * 10))); do
        grep -q 'rig: done' "$RUN/serial.log" 2>/dev/null && { grep 'rig: done' "$RUN/serial.log"; return 0; }
        sleep 0.1
    done
    echo "guest did not finish its frames in $timeout s" >&2; return 1
}

stop() {
    local port=${1:-5906} RUN
    RUN=$(run_dir "$port")
    rig_stop_pidfile "$RUN/qemu.pid" "$QEMU_RE"
    echo "stopped qemu port $port"
}

status() {
    local port=${1:-5906} RUN pid
    RUN=$(run_dir "$port"); pid=$(cat "$RUN/qemu.pid" 2>/dev/null || true)
    if rig_pid_matches "$pid" "$QEMU_RE"; then echo "qemu running pid $pid"; else echo "qemu not running"; fi
    grep 'rig:' "$RUN/serial.log" 2>/dev/null || true
}

case "$cmd" in
prepare) prepare;;
check) if why=$(check); then echo "qemu cache complete ($CACHE)"; else echo "incomplete: $why"; exit 1; fi;;
start) start "$@";;
wait-done) wait_done "$@";;
stop) stop "$@";;
status) status "$@";;
*) rig_usage; exit 2;;
esac
