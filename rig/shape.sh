#!/bin/bash
# Link shaping for the client<->relay leg, without netem (this kernel has
# HTB, TBF, u32, cls_bpf, ingress, IFB, veth, TUN, netns; no netem/fq/etf).
#
# Topology made by `up` (the client lives in its own network namespace; the
# relay and the SPICE server stay in the root namespace, server on 127.0.0.1):
#
#   netns rigc                          root netns
#   client.py --> rigc0 198.18.0.2 ==== rigr0 198.18.0.1 --> relay :6905 --> 127.0.0.1:5905
#
# 198.18.0.0/15 is the RFC 2544 benchmarking range; the two addresses exist
# only on this private pair of interfaces, nothing leaves the machine.
#
#   rig/shape.sh up veth                 # kernel veth pair, no delay
#   rig/shape.sh up tun [DOWN_MS [UP_MS]]  # TUN pair + rig/delayline.py (adds delay;
#                                        # UP_MS defaults to DOWN_MS, both to 10)
#   rig/shape.sh rate DOWN [UP]          # HTB on rigr0 (relay->client) [and rigc0;
#                                        # UP omitted = rigc0 left as it is]
#   rig/shape.sh tbf DOWN [UP]           # same with TBF instead of HTB
#   rig/shape.sh rate off                # remove rate limits (both ends)
#   rig/shape.sh lo PORT RATE            # no namespaces: HTB+u32 on lo, sport PORT
#   rig/shape.sh lo-off
#   rig/shape.sh rmem "4096 65536 262144"  # tcp_rmem inside the namespace only (per-netns
#                                        # sysctl): a stalled client then fills its
#                                        # receive queue after 256 KiB instead of ~32 MiB
#   rig/shape.sh status
#   rig/shape.sh down                    # remove namespace, devices, qdiscs, delayline,
#                                        # and the lo qdisc if `lo` set one
#
# Env (all optional; use different values to run two topologies side by side):
#   RIG_NS=rigc  RIG_A=rigr0  RIG_B=rigc0  RIG_IPA=198.18.0.1  RIG_IPB=198.18.0.2
#   RIG_STATE=/run/rig-shape-$RIG_NS  (delayline pid/log, link kind; `lo` leaves a
#   marker $RIG_STATE.lo)   QLIMIT=100
# Interface names must be at most 15 characters.
#
# Stale state: `up` first removes whatever an earlier run left with the same
# names (delayline from its pid file, devices, namespace), so it works after a
# crashed test.  `down` is safe to run any number of times; it warns if
# processes still live in the namespace (it does not kill them: whoever
# started them owns them; the namespace and its devices disappear when they exit).
#
# Rates are tc rates (e.g. 8mbit, 500kbit).  Leaf queues are `pfifo limit
# $QLIMIT` (default 100 packets) so the standing queue is in the sockets,
# not in a deep qdisc.  Run the client as:
#   ip netns exec rigc /path/to/rig/client.py spice://198.18.0.1:6905
# and the relay as:  rig/relay.sh socat 198.18.0.1 6905 127.0.0.1 5905 PIDFILE
set -Eeuo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
NS=${RIG_NS:-rigc}
A=${RIG_A:-rigr0}          # root-namespace end (relay side)
B=${RIG_B:-rigc0}          # client-namespace end
IPA=${RIG_IPA:-198.18.0.1}
IPB=${RIG_IPB:-198.18.0.2}
QLIMIT=${QLIMIT:-100}
STATE=${RIG_STATE:-/run/rig-shape-$NS}
LO_MARK=$STATE.lo          # set by `lo`, kept apart so that `up` does not undo it
DL_RE='delayline\.py'
inns() { ip netns exec "$NS" "$@"; }
ns_exists() { ip netns list | awk '{print $1}' | grep -qx "$NS"; }
dev_exists() { ip link show dev "$1" >/dev/null 2>&1; }

offloads_off() {  # MTU-sized packets through the shaper (veth does GSO/TSO)
    "$@" ethtool -K "$dev" tso off gso off gro off >/dev/null 2>&1 || true
}

# remove everything with our names; quiet, idempotent
cleanup() {
    local pids
    rig_stop_pidfile "$STATE/delayline.pid" "$DL_RE"
    if ns_exists; then
        pids=$(ip netns pids "$NS" 2>/dev/null | tr '\n' ' ' || true)
        [[ -n ${pids// /} ]] && echo "warning: processes still in netns $NS: $pids(not killed)" >&2
        ip netns del "$NS" 2>/dev/null || true
    fi
    # veth: deleting one end removes both; TUN ends vanish with the delayline
    for _ in $(seq 30); do
        dev_exists "$A" || dev_exists "$B" || break
        ip link del "$A" 2>/dev/null || true
        ip link del "$B" 2>/dev/null || true
        sleep 0.1
    done
    rm -rf "$STATE"
}

up() {
    local kind=${1:-veth}
    [[ $kind == veth || $kind == tun ]] || { echo "up veth|tun" >&2; exit 2; }
    cleanup
    mkdir -p "$STATE"
    trap 'echo "up failed; cleaning up" >&2; cleanup' ERR
    ip netns add "$NS"
    inns ip link set lo up
    case "$kind" in
    veth)
        ip link add "$A" type veth peer name "$B"
        ip link set "$B" netns "$NS"
        ip addr add "$IPA/30" dev "$A"
        inns ip addr add "$IPB/30" dev "$B"
        ip link set "$A" up; inns ip link set "$B" up
        dev=$A offloads_off; dev=$B offloads_off inns
        echo veth >"$STATE/kind"
        ;;
    tun)
        local down=${2:-10} upd=${3:-${2:-10}}
        rm -f "$STATE/ready"
        setsid "$RIG_PY" "$HERE/delayline.py" --a "$A" --b "$B" \
            --down-ms "$down" --up-ms "$upd" --ready "$STATE/ready" \
            >"$STATE/delayline.log" 2>&1 </dev/null &
        echo $! >"$STATE/delayline.pid"
        for _ in $(seq 50); do [[ -e $STATE/ready ]] && break; sleep 0.1; done
        [[ -e $STATE/ready ]] || { echo "delayline did not start" >&2; cat "$STATE/delayline.log" >&2; false; }
        ip link set "$B" netns "$NS"
        ip addr add "$IPA" peer "$IPB" dev "$A"
        inns ip addr add "$IPB" peer "$IPA" dev "$B"
        ip link set "$A" up; inns ip link set "$B" up
        echo "tun down=${down}ms up=${upd}ms" >"$STATE/kind"
        ;;
    esac
    trap - ERR
    echo "up: $(cat "$STATE/kind"); client netns $NS ($B $IPB) <-> $A $IPA"
}

qdisc_set() {  # qdisc_set KIND RATE DEV [netns-prefix...]
    local kind=$1 rate=$2 dev=$3; shift 3
    "$@" tc qdisc del dev "$dev" root 2>/dev/null || true
    [[ $rate == off ]] && return 0
    if [[ $kind == htb ]]; then
        "$@" tc qdisc add dev "$dev" root handle 1: htb default 10
        "$@" tc class add dev "$dev" parent 1: classid 1:10 htb rate "$rate" ceil "$rate" quantum 1514
        "$@" tc qdisc add dev "$dev" parent 1:10 handle 10: pfifo limit "$QLIMIT"
    else
        # burst must hold at least one MTU packet; latency bounds the queue
        "$@" tc qdisc add dev "$dev" root tbf rate "$rate" burst 16kb latency 100ms
    fi
}

rate() {
    local kind=$1 down=${2:?rate DOWN [UP]} upr=${3:-}
    if [[ ! -f $STATE/kind ]] || ! dev_exists "$A"; then rig_die "link is not up (run: $0 up veth|tun)"; fi
    qdisc_set "$kind" "$down" "$A"
    if [[ -n $upr || $down == off ]]; then qdisc_set "$kind" "${upr:-off}" "$B" inns; fi
    status
}

lo_shape() {  # shape only TCP from source port PORT on lo (relay->client leg)
    local port=${1:?PORT} r=${2:?RATE}
    mkdir -p "$(dirname "$LO_MARK")"; touch "$LO_MARK"
    tc qdisc del dev lo root 2>/dev/null || true
    tc qdisc add dev lo root handle 1: htb default 99
    tc class add dev lo parent 1: classid 1:99 htb rate 100gbit quantum 200000  # everything else
    tc class add dev lo parent 1: classid 1:10 htb rate "$r" ceil "$r" quantum 1514
    tc qdisc add dev lo parent 1:10 handle 10: pfifo limit "$QLIMIT"
    tc filter add dev lo parent 1: protocol ip prio 1 u32 \
        match ip protocol 6 0xff match ip sport "$port" 0xffff flowid 1:10
    tc -s class show dev lo
}

lo_off() {
    tc qdisc del dev lo root 2>/dev/null || true
    rm -f "$LO_MARK"
    echo "lo: no root qdisc"
}

status() {
    if [[ -f $STATE/kind ]]; then echo "link: $(cat "$STATE/kind")"; else echo "link: down"; fi
    echo "--- root $A"; tc -s qdisc show dev "$A" 2>/dev/null || true
    echo "--- $NS $B"; ns_exists && { inns tc -s qdisc show dev "$B" 2>/dev/null || true; }
    if [[ -f $STATE/delayline.pid ]] && kill -USR1 "$(cat "$STATE/delayline.pid")" 2>/dev/null; then
        sleep 0.2; tail -2 "$STATE/delayline.log" || true
    fi
    return 0
}

down() {
    [[ -f $STATE/delayline.log ]] && { tail -2 "$STATE/delayline.log" || true; }
    cleanup
    if [[ -f $LO_MARK ]]; then tc qdisc del dev lo root 2>/dev/null || true; rm -f "$LO_MARK"; fi
    echo "down: netns $NS, $A/$B removed"
}

case "${1:-}" in
up) shift; up "$@";;
rate) shift; rate htb "$@";;
tbf) shift; rate tbf "$@";;
lo) shift; lo_shape "$@";;
lo-off) lo_off;;
rmem) shift; inns sysctl -w net.ipv4.tcp_rmem="${1:?\"MIN DEF MAX\"}";;
status) status;;
down) down;;
*) rig_usage; exit 2;;
esac
