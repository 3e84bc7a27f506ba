#!/bin/bash
# Xspice: Xorg 21.1 with the spiceqxl driver (Debian xserver-xspice
# 0.1.5+git20200331, libspice-server1 0.15.1) serving SPICE on a loopback port,
# plus an animating X client (rig/xanim.py) that keeps display traffic flowing.
#
#   rig/start-xspice.sh start  [PORT] [DISPLAY_NUM] [--tls X509_DIR] [-- XANIM_OPTIONS...]
#   rig/start-xspice.sh stop   [PORT]
#   rig/start-xspice.sh status [PORT]
# e.g.
#   rig/start-xspice.sh start 5905 5 -- --mode noise --fps 20 --size 256x192
#   rig/start-xspice.sh start 5905 5 -- --mode rects --fps 50 --count 20 --seconds 10
#   rig/start-xspice.sh stop 5905
#   rig/tls-certs.sh /tmp/t1/x509 && rig/start-xspice.sh start 5905 5 --tls /tmp/t1/x509
#                # TLS only: 5905 is spice-server's TLS port, there is no plain port
# Defaults: PORT 5905, DISPLAY_NUM 5, xanim `--mode noise --fps 20 --size 256x192`.
# `xanim.py --seconds N` (or --frames N) stops the animation by itself, Xspice keeps
# running (idle session).
#
# Listens on $XSPICE_ADDR:PORT (default 127.0.0.1), no ticketing, no TLS.
# With --tls X509_DIR, PORT is a TLS port instead and there is no plain port
# (XSPICE_PORT=0 XSPICE_TLS_PORT=PORT XSPICE_X509_DIR=X509_DIR): every channel,
# link phase included, is inside TLS (OpenSSL 3, libssl.so.3 mapped by Xorg).
# X509_DIR holds ca-cert.pem, server-cert.pem, server-key.pem (rig/tls-certs.sh
# makes them); spice-server aborts when one is missing, so this script checks
# first.  Clients: spice://127.0.0.1?tls-port=PORT with the CA
# (rig/client.py --ca-file X509_DIR/ca-cert.pem).
# `start` returns once the port listens and the first frame is drawn (~0.5 s).
# State (pid files, logs, generated xorg.conf) in $RIG_RUN, default
# /tmp/rig-xspice-PORT: Xorg.pid, xanim.pid, display, xorg.log, xspice.log, xanim.log.
# Set SPICE_DEBUG_LOG=1 to run with G_MESSAGES_DEBUG=all: spice-server then
# logs e.g. "net test: latency ... bitrate ..." into $RIG_RUN/xspice.log.
#
# Stale state: `start` first stops whatever an earlier run with the same
# $RIG_RUN left running (pid files), removes /tmp/.X<N>-lock and
# /tmp/.X11-unix/X<N> when the PID in the lock is dead, and refuses (exit 1)
# if the display or the port is held by a live process it did not start.
#
# Why Xorg is run directly with a generated xorg.conf instead of `Xspice --auto`:
# the packaged config makes this Xorg abort (buffer sizes come out as 0 ->
# "malloc(): corrupted top size"), and with only QXL_*_BUFFER_SIZE set it
# segfaults in xf86InitViewport (no outputs, no modes).  Explicit
# FrameBufferSize/SurfaceBufferSize/CommandBufferSize plus a Monitor with a
# 1024x768 modeline fix both.  The /usr/bin/Xspice python wrapper only turns
# its options into XSPICE_* environment variables and runs Xorg; on SIGTERM it
# kills Xorg but does not exit itself, so it is left out: one process, whose
# SIGTERM removes its own X lock.  ("xspicekeyboard/xspicepointer module does
# not exist" in xorg.log is harmless.)
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"

cmd=${1:-}; shift || true
port=5905; dnum=5
[[ $# -gt 0 && $1 != -- ]] && { port=$1; shift; }
[[ $# -gt 0 && $1 != -- ]] && { dnum=$1; shift; }
tls_dir=""
if [[ $# -gt 1 && $1 == --tls ]]; then tls_dir=$(readlink -f "$2"); shift 2; fi
[[ $# -gt 0 && $1 == -- ]] && shift
[[ $port =~ ^[0-9]+$ && $dnum =~ ^[0-9]+$ ]] || rig_die "bad PORT/DISPLAY_NUM '$port' '$dnum'"
RUN=${RIG_RUN:-/tmp/rig-xspice-$port}
ADDR=${XSPICE_ADDR:-127.0.0.1}
XORG=/usr/lib/xorg/Xorg
XORG_RE='Xorg .*-config'

stop() {
    local d
    d=$(cat "$RUN/display" 2>/dev/null || echo "$dnum")
    # the X client first, then Xorg (SIGTERM: it removes /tmp/.X<N>-lock itself)
    rig_stop_pidfile "$RUN/xanim.pid" 'xanim\.py'
    rig_stop_pidfile "$RUN/Xorg.pid" "$XORG_RE"
    clean_stale_lock "$d" >/dev/null || true
    rm -f "$RUN/display"
    echo "stopped Xspice :$d port $port"
}

# remove /tmp/.X<N>-lock (+ socket) if its PID is dead; fail if it is alive
clean_stale_lock() {
    local d=$1 lock=/tmp/.X$1-lock pid
    [[ -e $lock ]] || { rm -f "/tmp/.X11-unix/X$d"; return 0; }
    pid=$(tr -dc '0-9' <"$lock" 2>/dev/null || true)
    if rig_alive "$pid"; then
        echo "display :$d is in use by live pid $pid ($(rig_cmdline "$pid"))" >&2
        return 1
    fi
    rm -f "$lock" "/tmp/.X11-unix/X$d"
    echo "removed stale X lock of dead pid ${pid:-?} for :$d"
}

start() {
    local xargs_=("$@")
    [[ ${#xargs_[@]} -gt 0 ]] || xargs_=(--mode noise --fps 20 --size 256x192)
    [[ -x $XORG ]] || rig_die "$XORG missing (apt-get install xserver-xspice)"
    mkdir -p "$RUN"
    # leftovers of an earlier run with the same state dir
    if [[ -f $RUN/Xorg.pid || -f $RUN/xanim.pid ]]; then stop >/dev/null; fi
    clean_stale_lock "$dnum" || exit 1
    if rig_listening "$port"; then
        echo "port $port is already in use:" >&2; rig_listener_info "$port" >&2; exit 1
    fi
    rm -f "$RUN"/*.log
    cat >"$RUN/xorg.conf" <<EOF
Section "Device"
    Identifier "XSPICE"
    Driver "spiceqxl"
    Option "SpiceAddr" "$ADDR"
    Option "FrameBufferSize" "16"
    Option "SurfaceBufferSize" "64"
    Option "CommandBufferSize" "128"
    Option "NumHeads" "1"
EndSection
Section "InputDevice"
    Identifier "XSPICE POINTER"
    Driver     "xspice pointer"
EndSection
Section "InputDevice"
    Identifier "XSPICE KEYBOARD"
    Driver     "xspice keyboard"
EndSection
Section "Monitor"
    Identifier  "Configured Monitor"
    HorizSync   20-200
    VertRefresh 20-120
    Modeline "1024x768" 63.50 1024 1072 1176 1328 768 771 775 798 -hsync +vsync
EndSection
Section "Screen"
    Identifier "XSPICE Screen"
    Monitor    "Configured Monitor"
    Device     "XSPICE"
    DefaultDepth 24
    SubSection "Display"
        Depth   24
        Virtual 1024 768
        Modes   "1024x768"
    EndSubSection
EndSection
Section "ServerLayout"
    Identifier  "XSPICE Example"
    Screen      "XSPICE Screen"
    InputDevice "XSPICE KEYBOARD"
    InputDevice "XSPICE POINTER"
EndSection
Section "ServerFlags"
    Option "AutoAddDevices" "False"
EndSection
EOF
    local envs=(XSPICE_PORT="$port" XSPICE_DISABLE_TICKETING=1 XSPICE_TLS_PORT=0) f
    if [[ -n $tls_dir ]]; then
        for f in ca-cert.pem server-cert.pem server-key.pem; do
            [[ -r $tls_dir/$f ]] || rig_die "--tls $tls_dir: $f missing (rig/tls-certs.sh $tls_dir)"
        done
        envs=(XSPICE_PORT=0 XSPICE_TLS_PORT="$port" XSPICE_X509_DIR="$tls_dir" XSPICE_DISABLE_TICKETING=1)
    fi
    [[ ${SPICE_DEBUG_LOG:-0} == 1 ]] && envs+=(G_MESSAGES_DEBUG=all)
    echo "$dnum" >"$RUN/display"
    # -noreset is mandatory (the driver cannot survive a server reset)
    env "${envs[@]}" setsid "$XORG" -config "$RUN/xorg.conf" -noreset ":$dnum" \
        -nolisten tcp -logfile "$RUN/xorg.log" >"$RUN/xspice.log" 2>&1 </dev/null &
    local xpid=$!
    echo "$xpid" >"$RUN/Xorg.pid"
    for _ in $(seq 100); do
        rig_listening "$port" && [[ -S /tmp/.X11-unix/X$dnum ]] && break
        rig_alive "$xpid" || break
        sleep 0.1
    done
    if ! rig_alive "$xpid" || ! rig_listening "$port"; then
        echo "Xspice did not come up; see $RUN/xspice.log $RUN/xorg.log" >&2
        tail -20 "$RUN/xspice.log" >&2 || true
        stop >/dev/null; exit 1
    fi
    rm -f "$RUN/xanim.ready"
    DISPLAY=:$dnum setsid "$RIG_PY" "$HERE/xanim.py" --ready-file "$RUN/xanim.ready" "${xargs_[@]}" \
        >"$RUN/xanim.log" 2>&1 </dev/null &
    echo $! >"$RUN/xanim.pid"
    for _ in $(seq 100); do
        [[ -e $RUN/xanim.ready ]] && break
        rig_alive "$(cat "$RUN/xanim.pid")" || break
        sleep 0.05
    done
    if [[ ! -e $RUN/xanim.ready ]]; then
        echo "xanim did not start drawing:" >&2; cat "$RUN/xanim.log" >&2 || true
        stop >/dev/null; exit 1
    fi
    echo "Xspice :$dnum on $ADDR:$port${tls_dir:+ (TLS only, $tls_dir)} (Xorg pid $xpid, xanim pid $(cat "$RUN/xanim.pid"), state $RUN)"
}

status() {
    local f pid
    for f in Xorg xanim; do
        pid=$(cat "$RUN/$f.pid" 2>/dev/null || true)
        if rig_alive "$pid"; then echo "$f: running pid $pid"; else echo "$f: not running"; fi
    done
    rig_listening "$port" && echo "port $port: listening" || echo "port $port: not listening"
}

case "$cmd" in
start) start "$@";;
stop) stop;;
status) status;;
*) rig_usage; exit 2;;
esac
