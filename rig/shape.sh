#!/bin/bash
# Link shaping for the client<->relay leg.  Delay uses netem when the kernel
# has it (probed, see `netem`), else the userspace delay line of `up tun` (this
# kernel: HTB, TBF, u32, cls_bpf, ingress, IFB, veth, TUN, netns; no netem/fq/etf).
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
#   rig/shape.sh rate off                # remove rate limits (both ends; a netem delay stays)
#   rig/shape.sh netem                   # probe: does `tc qdisc add ... netem delay`
#                                        # work here?  prints "netem: yes" (exit 0) or
#                                        # "netem: no (...)" (exit 1); tried on `lo` of a
#                                        # throwaway netns, nothing else is touched
#   rig/shape.sh delay DOWN_MS [UP_MS]   # veth link + netem: delay on rigr0 (relay->client)
#                                        # and rigc0 (client->relay; UP_MS defaults to
#                                        # DOWN_MS); combines with rate/tbf (netem becomes
#                                        # the HTB leaf / the TBF child).  No netem: exit 1
#                                        # with "use: shape.sh up tun DOWN_MS UP_MS"
#   rig/shape.sh delay off               # remove the netem delay (rates stay)
#   rig/shape.sh up auto [DOWN_MS [UP_MS]] # netem here? then `up veth` + `delay D U`,
#                                        # else `up tun D U` (the delay line); says which
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
#   RIG_STATE=/run/rig-shape-$RIG_NS  (delayline pid/log, link kind, rate.a/rate.b,
#   delay; `lo` leaves a marker $RIG_STATE.lo)   QLIMIT=100
#   NETEM_LIMIT=1000  (netem queue in packets: it holds the packets in flight
#   on the "wire" too, so it must exceed rate*delay/MTU, unlike QLIMIT)
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
# not in a deep qdisc (with `delay` the leaf is `netem delay Nms limit
# $NETEM_LIMIT` instead).  `rate`, `tbf` and `delay` remember their settings in
# $RIG_STATE and rebuild the device's whole qdisc tree from them, so they can be
# given in any order.  Run the client as:
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
NETEM_LIMIT=${NETEM_LIMIT:-1000}
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

# netem_probe: 0 if `tc qdisc add ... netem delay` works in this kernel.
# Tried on lo of a throwaway namespace (no module autoload here: no
# /lib/modules; where there is one, tc's request loads sch_netem).
# Sets NETEM_WHY to tc's error.
NETEM_WHY=""
netem_probe() {
    local pns="${NS}-netemprobe-$$" rc=0
    ip netns del "$pns" 2>/dev/null || true
    ip netns add "$pns" || { NETEM_WHY="cannot create probe netns $pns"; return 1; }
    NETEM_WHY=$(ip netns exec "$pns" tc qdisc add dev lo root netem delay 1ms 2>&1) || rc=1
    ip netns del "$pns" 2>/dev/null || true
    NETEM_WHY=${NETEM_WHY//$'\n'/ }
    return $rc
}

netem_cmd() {
    if netem_probe; then
        echo "netem: yes (tc qdisc ... netem delay works): use \`$0 up veth\` + \`$0 delay DOWN_MS UP_MS\` (or \`up auto D U\`)"
        return 0
    fi
    echo "netem: no (${NETEM_WHY:-tc failed}): delay with \`$0 up tun DOWN_MS UP_MS\` (delayline.py)"
    return 1
}

up() {
    local kind=${1:-veth}
    if [[ $kind == auto ]]; then
        local d=${2:-10} u=${3:-${2:-10}}
        if netem_probe; then
            echo "up auto: netem available -> veth + netem delay ${d}/${u} ms"
            up veth; delay_cmd "$d" "$u" >/dev/null
            echo "veth+netem down=${d}ms up=${u}ms" >"$STATE/kind"
            echo "up: $(cat "$STATE/kind")"
        else
            echo "up auto: no netem (${NETEM_WHY:-?}) -> tun + delayline.py ${d}/${u} ms"
            up tun "$d" "$u"
        fi
        return 0
    fi
    [[ $kind == veth || $kind == tun ]] || { echo "up veth|tun|auto" >&2; exit 2; }
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

# qdisc_set KIND RATE DEV DELAY_MS [netns-prefix...]: (re)build DEV's root
# qdisc tree: KIND htb|tbf at RATE (or RATE off = no shaper), with netem
# DELAY_MS (0 = none) as the HTB leaf / TBF child / root.
qdisc_set() {
    local kind=$1 rate=$2 dev=$3 dms=$4; shift 4
    local leaf=(pfifo limit "$QLIMIT")
    [[ $dms != 0 ]] && leaf=(netem delay "${dms}ms" limit "$NETEM_LIMIT")
    "$@" tc qdisc del dev "$dev" root 2>/dev/null || true
    if [[ $rate == off ]]; then
        [[ $dms != 0 ]] && "$@" tc qdisc add dev "$dev" root handle 1: "${leaf[@]}"
        return 0
    fi
    if [[ $kind == htb ]]; then
        "$@" tc qdisc add dev "$dev" root handle 1: htb default 10
        "$@" tc class add dev "$dev" parent 1: classid 1:10 htb rate "$rate" ceil "$rate" quantum 1514
        "$@" tc qdisc add dev "$dev" parent 1:10 handle 10: "${leaf[@]}"
    else
        # burst must hold at least one MTU packet; latency bounds the queue
        "$@" tc qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst 16kb latency 100ms
        [[ $dms != 0 ]] && "$@" tc qdisc add dev "$dev" parent 1:1 handle 10: "${leaf[@]}"
    fi
    return 0
}

# remembered settings: $STATE/rate.a|rate.b = "KIND RATE", $STATE/delay = "DOWN UP"
get_rate() { cat "$STATE/rate.$1" 2>/dev/null || echo "htb off"; }
get_delay() {  # get_delay a|b -> ms
    local d u
    [[ -f $STATE/delay ]] && read -r d u <"$STATE/delay" || { echo 0; return; }
    if [[ $1 == a ]]; then echo "${d:-0}"; else echo "${u:-0}"; fi
}
rebuild() {  # rebuild a|b
    local k r
    read -r k r < <(get_rate "$1")
    if [[ $1 == a ]]; then qdisc_set "$k" "$r" "$A" "$(get_delay a)"
    else qdisc_set "$k" "$r" "$B" "$(get_delay b)" inns; fi
}
need_link() {
    if [[ ! -f $STATE/kind ]] || ! dev_exists "$A"; then rig_die "link is not up (run: $0 up veth|tun)"; fi
}

rate() {
    local kind=$1 down=${2:?rate DOWN [UP]} upr=${3:-}
    need_link
    echo "$kind $down" >"$STATE/rate.a"
    rebuild a
    if [[ -n $upr || $down == off ]]; then echo "$kind ${upr:-off}" >"$STATE/rate.b"; rebuild b; fi
    status
}

delay_cmd() {
    local down=${1:?delay DOWN_MS [UP_MS] | delay off} upd=${2:-${1:-}}
    need_link
    if [[ $(cat "$STATE/kind") == tun* ]]; then
        rig_die "link is $(cat "$STATE/kind"): its delay is delayline.py's (set by \`up tun DOWN_MS UP_MS\`)"
    fi
    if [[ $down == off ]]; then
        rm -f "$STATE/delay"
    else
        [[ $down =~ ^[0-9]+$ && $upd =~ ^[0-9]+$ ]] || rig_die "delay: DOWN_MS/UP_MS must be whole milliseconds"
        if ! netem_probe; then
            echo "${0##*/}: no netem in this kernel (${NETEM_WHY:-tc failed}); for delay use: $0 up tun $down $upd" >&2
            exit 1
        fi
        echo "$down $upd" >"$STATE/delay"
    fi
    rebuild a
    rebuild b
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
    [[ -f $STATE/delay ]] && echo "netem delay (down up ms): $(cat "$STATE/delay")"
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
netem) netem_cmd;;
delay) shift; delay_cmd "$@";;
rmem) shift; inns sysctl -w net.ipv4.tcp_rmem="${1:?\"MIN DEF MAX\"}";;
status) status;;
down) down;;
*) rig_usage; exit 2;;
esac
