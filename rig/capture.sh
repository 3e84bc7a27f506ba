#!/bin/bash
# Capture SPICE traffic for tshark (oracle for tests).
#
#   rig/capture.sh start OUT.pcapng [-n NETNS] [-i IFACE] PORT [PORT...]
#   rig/capture.sh stop  OUT.pcapng
#
# Uses dumpcap (Debian's tshark/wireshark-common) with a 256 MiB kernel
# buffer: plain `tshark -i lo` with its default 2 MiB buffer dropped packets
# at ~35 Mbit/s of display traffic, and one lost segment makes the rest of a
# SPICE stream undecodable.  Start the capture BEFORE the client connects:
# SPICE can only be decoded from the link messages on.  `start` returns once
# dumpcap has created the file (from then on packets are kept).
# State: OUT.pcapng.pid and OUT.pcapng.log next to the output; a pid file left
# by an earlier run is stopped first (only if its PID is still dumpcap).
# Default interface is lo (root namespace).  For the namespaced topology of
# rig/shape.sh capture the client leg inside the client namespace, e.g.
#   rig/capture.sh start /tmp/c.pcapng -n rigc -i rigc0 6905
# and analyse with
#   tshark -r /tmp/c.pcapng -d tcp.port==6905,spice -Y spice
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
[[ $# -ge 2 ]] || { rig_usage; exit 2; }
cmd=$1; out=$2; shift 2
pidf="$out.pid"
RE='dumpcap '
case "$cmd" in
start)
    ns=""; ifc=lo
    while [[ $# -gt 0 && $1 == -* ]]; do
        case "$1" in -n) ns=$2; shift 2;; -i) ifc=$2; shift 2;; *) rig_die "bad option $1";; esac
    done
    [[ $# -ge 1 ]] || rig_die "need at least one PORT"
    filt=""; for p in "$@"; do filt="${filt:+$filt or }tcp port $p"; done
    pre=(); [[ -n $ns ]] && pre=(ip netns exec "$ns")
    mkdir -p "$(dirname "$out")"
    rig_stop_pidfile "$pidf" "$RE"
    rm -f "$out" "$out.log"   # a stale file would fool the readiness check below
    setsid "${pre[@]}" dumpcap -q -i "$ifc" -B 256 -s 0 -f "$filt" -w "$out" >"$out.log" 2>&1 </dev/null &
    echo $! >"$pidf"
    # dumpcap opens the interface and sets the filter first, then creates the
    # file and prints "File: ..." to stderr: from then on packets are kept.
    for _ in $(seq 100); do grep -q '^File:' "$out.log" 2>/dev/null && break; sleep 0.05; done
    if ! grep -q '^File:' "$out.log"; then
        echo "dumpcap did not start:" >&2; cat "$out.log" >&2
        rig_stop_pidfile "$pidf" "$RE"; exit 1
    fi
    echo "capturing on $ifc${ns:+ (netns $ns)} filter '$filt' -> $out (pid $(cat "$pidf"))"
    ;;
stop)
    [[ -f $pidf ]] || { echo "no $pidf (not running)"; exit 0; }
    pid=$(cat "$pidf")
    # SIGINT: dumpcap finishes the file and prints its packet/drop counts
    rig_pid_matches "$pid" "$RE" && kill -INT "$pid" 2>/dev/null || true
    for _ in $(seq 50); do rig_alive "$pid" || break; sleep 0.1; done
    rig_stop_pidfile "$pidf" "$RE"
    cat "$out.log" >&2 || true
    ;;
*) rig_usage; exit 2;;
esac
