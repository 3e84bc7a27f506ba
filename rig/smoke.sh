#!/bin/bash
# End-to-end smoke test of the rig (needs root and scripts/setup.sh done):
#
#   rig/smoke.sh [xspice] [veth] [tun] [qemu] [relaybuf] [auto]   # default: xspice veth tun
#
#   xspice : Xspice (noise) + socat relay on 127.0.0.1 + client.py 6 s with a
#            SIGUSR1/SIGUSR2 pause; checks display traffic in the SUMMARY
#   veth   : shape.sh up veth + rate 8mbit 8mbit, relay on 198.18.0.1, client
#            inside the namespace; checks traffic and that `down` leaves nothing
#   tun    : shape.sh up tun 20 20; checks ping RTT 38-60 ms; down
#   qemu   : start-qemu.sh with 100 frames, client through the relay; checks
#            display traffic, then that the guest stops drawing (no display
#            bytes after "rig: done")
#   relaybuf : socat and haproxy with RIG_RELAY_RCVBUF=1048576 RIG_RELAY_SNDBUF=262144;
#            checks skmem rb2097152 on the relay->server sockets and tb524288 on
#            the relay->client sockets of a live session (`ss -tm`)
#   auto   : shape.sh up auto 20 20 (netem if the kernel has it, else the TUN
#            delay line); checks ping RTT 38-60 ms; down
# Ports 15905 (server), 16905 (relay), 15906 (qemu), display :15, state under
# $RIG_SMOKE_DIR (default /tmp/rig-smoke).  Everything it starts is stopped on
# exit, also on failure.  Prints "N passed, N failed".
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
D=${RIG_SMOKE_DIR:-/tmp/rig-smoke}
SP=15905 RP=16905 QP=15906 DN=15
export RIG_NS=rigsmoke RIG_A=rigsmk0r RIG_B=rigsmk0c
tests=("$@"); [[ ${#tests[@]} -gt 0 ]] || tests=(xspice veth tun)
pass=0 failn=0
mkdir -p "$D"

cleanup() {
    "$HERE/relay.sh" stop "$D/relay.pid" >/dev/null 2>&1 || true
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" stop $SP >/dev/null 2>&1 || true
    RIG_RUN=$D/qemu "$HERE/start-qemu.sh" stop $QP >/dev/null 2>&1 || true
    "$HERE/shape.sh" down >/dev/null 2>&1 || true
}
trap cleanup EXIT

result() { if [[ $1 == 0 ]]; then echo "PASS $2"; pass=$((pass + 1)); else echo "FAIL $2"; failn=$((failn + 1)); fi; }
# display bytes from a client SUMMARY line
disp_bytes() { grep '^SUMMARY ' "$1" | sed 's/^SUMMARY //' |
    "$RIG_PY" -c 'import json,sys; print(json.load(sys.stdin)["channels"].get("display-0",{}).get("read_bytes",0))'; }

t_xspice() {
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" start $SP $DN -- --mode noise --fps 20 --size 256x192
    "$HERE/relay.sh" socat 127.0.0.1 $RP 127.0.0.1 $SP "$D/relay.pid"
    "$HERE/client.py" spice://127.0.0.1:$RP --seconds 6 --report 2 >"$D/client.log" &
    local c=$!
    sleep 2; kill -USR1 $c; sleep 1; kill -USR2 $c
    wait $c
    grep -q 'SIGUSR2: resumed' "$D/client.log"
    local b; b=$(disp_bytes "$D/client.log"); echo "display bytes $b"
    "$HERE/relay.sh" stop "$D/relay.pid"
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" stop $SP
    [[ $b -gt 5000000 ]]
}

t_veth() {
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" start $SP $DN
    "$HERE/shape.sh" up veth
    "$HERE/shape.sh" rate 8mbit 8mbit >/dev/null
    "$HERE/relay.sh" socat 198.18.0.1 $RP 127.0.0.1 $SP "$D/relay.pid"
    ip netns exec "$RIG_NS" "$HERE/client.py" spice://198.18.0.1:$RP --seconds 6 --report 3 >"$D/client.log"
    local b; b=$(disp_bytes "$D/client.log"); echo "display bytes $b (8 mbit/s link)"
    "$HERE/relay.sh" stop "$D/relay.pid"
    "$HERE/shape.sh" down
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" stop $SP
    ! ip netns list | grep -qw "$RIG_NS" && ! ip link show "$RIG_A" >/dev/null 2>&1 &&
        [[ $b -gt 1000000 && $b -lt 7000000 ]]
}

t_tun() {
    "$HERE/shape.sh" up tun 20 20
    local avg
    avg=$(ip netns exec "$RIG_NS" ping -c 5 -i 0.2 -q 198.18.0.1 | awk -F/ '/^rtt/ {print $5}')
    echo "ping rtt avg $avg ms"
    "$HERE/shape.sh" down
    ! ip netns list | grep -qw "$RIG_NS" && awk -v a="$avg" 'BEGIN {exit !(a >= 38 && a <= 60)}'
}

t_qemu() {
    RIG_RUN=$D/qemu "$HERE/start-qemu.sh" start $QP noise 20 192 100
    "$HERE/relay.sh" socat 127.0.0.1 $RP 127.0.0.1 $QP "$D/relay.pid"
    "$HERE/client.py" spice://127.0.0.1:$RP --seconds 30 --report 1 >"$D/client.log" &
    local c=$!
    RIG_RUN=$D/qemu "$HERE/start-qemu.sh" wait-done $QP 60
    sleep 2   # let the last frames drain
    local b1; b1=$(awk '/^t=/ {n++} END {print n}' "$D/client.log")
    sleep 3
    kill -TERM $c; wait $c || true
    # display rate in the report lines after the guest stopped (last 2 lines)
    local tail_rate; tail_rate=$(grep '^t=' "$D/client.log" | tail -2 | grep -o 'display-0 [0-9]*kB/s' | grep -o '[0-9]*' | sort -n | tail -1)
    local b; b=$(disp_bytes "$D/client.log"); echo "display bytes $b, after done: ${tail_rate:-?} kB/s ($b1 report lines)"
    "$HERE/relay.sh" stop "$D/relay.pid"
    RIG_RUN=$D/qemu "$HERE/start-qemu.sh" stop $QP
    [[ $b -gt 1000000 && ${tail_rate:-1} -eq 0 ]]
}

t_relaybuf() {
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" start $SP $DN -- --mode noise --fps 20 --size 128x96
    local k c ok=0 srv cli
    for k in socat haproxy; do
        RIG_RELAY_RCVBUF=1048576 RIG_RELAY_SNDBUF=262144 "$HERE/relay.sh" $k 127.0.0.1 $RP 127.0.0.1 $SP "$D/relay.pid"
        "$HERE/client.py" spice://127.0.0.1:$RP --seconds 3 --report 3 >"$D/client.log" &
        c=$!
        sleep 1.5
        # distinct skmem rb / tb values over the session's (4) connections
        srv=$(ss -Htm state established "dport = :$SP" | grep -o ',rb[0-9]*' | sort -u | tr -d ',' | tr '\n' ' ')
        cli=$(ss -Htm state established "sport = :$RP" | grep -o ',tb[0-9]*' | sort -u | tr -d ',' | tr '\n' ' ')
        wait $c
        echo "$k: relay->server sockets ${srv}; relay->client sockets ${cli}"
        [[ $srv == "rb2097152 " && $cli == "tb524288 " ]] || ok=1
        "$HERE/relay.sh" stop "$D/relay.pid"
    done
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" stop $SP
    return $ok
}

t_auto() {
    "$HERE/shape.sh" netem || true
    "$HERE/shape.sh" up auto 20 20
    local avg
    avg=$(ip netns exec "$RIG_NS" ping -c 5 -i 0.2 -q "${RIG_IPA:-198.18.0.1}" | awk -F/ '/^rtt/ {print $5}')
    echo "ping rtt avg $avg ms"
    "$HERE/shape.sh" down
    ! ip netns list | grep -qw "$RIG_NS" && awk -v a="$avg" 'BEGIN {exit !(a >= 38 && a <= 60)}'
}

for t in "${tests[@]}"; do
    echo "=== $t"
    set +e
    ( set -e; "t_$t" ) 2>&1 | sed 's/^/  /'
    rc=${PIPESTATUS[0]}
    set -e
    cleanup
    result "$rc" "$t"
done
echo "$pass passed, $failn failed"
[[ $failn -eq 0 ]]
