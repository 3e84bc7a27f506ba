#!/bin/bash
# TCP relay ("SPICE proxy") between client and spice-server.  SPICE opens one
# TCP connection per channel (main, display, inputs, cursor, ...), all to the
# same port, so a plain per-connection TCP forwarder is enough: every accepted
# connection gets its own upstream connection.
#
#   rig/relay.sh socat   LISTEN_ADDR LISTEN_PORT SERVER_ADDR SERVER_PORT [PIDFILE]
#   rig/relay.sh haproxy LISTEN_ADDR LISTEN_PORT SERVER_ADDR SERVER_PORT [PIDFILE]
#   rig/relay.sh haproxy LISTEN_ADDR LPORT1,LPORT2,... SERVER_ADDR SPORT1,SPORT2,... [PIDFILE]
#   rig/relay.sh stop    PIDFILE
#   rig/relay.sh status  PIDFILE
# e.g.
#   rig/relay.sh socat 127.0.0.1 6905 127.0.0.1 5905 /tmp/t1/relay.pid
#   rig/relay.sh socat 198.18.0.1 6905 127.0.0.1 5905   # client side of rig/shape.sh
#   rig/relay.sh stop /tmp/t1/relay.pid
#   rig/relay.sh haproxy 127.0.0.1 6961,6962 127.0.0.1 5961,5962 /tmp/t2/relay.pid
#                # ONE haproxy process, one frontend per pair: 6961->5961, 6962->5962
#                # (several sessions through one relay process; haproxy only)
#
# PIDFILE defaults to $RIG_RELAY_DIR/rig-relay-LISTEN_PORT.pid (the first port
# of a list; RIG_RELAY_DIR default /tmp); its directory is created.  Next to
# it: NAME.log (and NAME.cfg for haproxy).  The PID is the listening process,
# started with setsid, so it leads a process group:
#   socat   : TCP-LISTEN,fork: one forked child per connection, in that group;
#             `stop` signals the whole group.  Default 8 KiB per read (-b).
#   haproxy : 2.6, mode tcp, one process (-db: foreground, no daemon fork);
#             timeouts 1 h so idle SPICE channels (inputs, cursor) are not cut.
#
# Socket buffers (optional env, bytes; unset/empty/0 = kernel autotuning as before):
#   RIG_RELAY_RCVBUF=N  SO_RCVBUF on the relay's connection TOWARD spice-server
#                       (set before connect(), so the window scale fits).  A slow
#                       client leg's backlog reaches this receive queue once the
#                       client-leg send queue is full: with autotuning that holds
#                       ~0.6 MB first, so add a small RIG_RELAY_SNDBUF (e.g. 65536).
#                       socat: `TCP:SADDR:SPORT,rcvbuf=N`; haproxy: `tune.rcvbuf.server N`
#   RIG_RELAY_SNDBUF=N  SO_SNDBUF on the relay's connection TOWARD the client.
#                       socat: `TCP-LISTEN:...,sndbuf=N` (the accepted sockets inherit
#                       it); haproxy: `tune.sndbuf.client N`
#   RIG_RELAY_BUFSIZE=N the relay's userspace buffer: socat `-b N` (default 8192),
#                       haproxy `tune.bufsize N` (default 16384)
# The kernel doubles SO_RCVBUF/SO_SNDBUF (skmem rb/tb = 2*N in `ss -tm`) and
# caps N at net.core.rmem_max / wmem_max (4194304 here; a warning is printed when N
# is larger; raise the sysctl if you need more).  Fixed buffers turn autotuning
# off for that socket.  e.g.
#   RIG_RELAY_RCVBUF=2097152 rig/relay.sh socat 198.18.0.1 6905 127.0.0.1 5905 /tmp/t1/relay.pid
#   ss -tmi 'dport = :5905'     # relay->server leg: skmem:(r...,rb4194304,...)
#
# Syscalls (for an eBPF observer of the relay): socat moves the bytes with
# read()/write(); haproxy with recvfrom()/sendto() (recv/send).  Neither splices:
# socat never does, and the generated haproxy config says `nosplice` (global) and
# `no option splice-auto|splice-request|splice-response` (defaults), which are
# also haproxy 2.6's defaults.  (Verified with strace -f on a live session.)
#
# `start` returns once the port listens.  Stale state: a PIDFILE left by an
# earlier run is stopped first (only if its PID is still socat/haproxy); a port
# held by anything else is an error.  LISTEN_ADDR must exist (for 198.18.0.1:
# run `rig/shape.sh up` first; stop the relay before `rig/shape.sh down`).
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
RE='(^|/)(socat|haproxy) '

kind=${1:-}
case "$kind" in
stop)
    pidf=${2:?PIDFILE}
    rig_stop_pidfile "$pidf" "$RE" 1
    rm -f "${pidf%.pid}.cfg"
    echo "relay stopped ($pidf)"; exit 0;;
status)
    pidf=${2:?PIDFILE}; pid=$(cat "$pidf" 2>/dev/null || true)
    if rig_pid_matches "$pid" "$RE"; then echo "relay running pid $pid"; else echo "relay not running"; exit 1; fi
    exit 0;;
socat|haproxy) ;;
*) rig_usage; exit 2;;
esac
[[ $# -ge 5 ]] || { rig_usage; exit 2; }
laddr=$2 lport=$3 saddr=$4 sport=$5
# comma-separated port lists (haproxy): LISTEN_PORT i forwards to SERVER_PORT i
IFS=, read -ra lports <<<"$lport"
IFS=, read -ra sports <<<"$sport"
[[ ${#lports[@]} -eq ${#sports[@]} ]] \
    || rig_die "LISTEN_PORT list ($lport) and SERVER_PORT list ($sport) differ in length"
for p in "${lports[@]}" "${sports[@]}"; do
    [[ $p =~ ^[0-9]+$ ]] || rig_die "not a port: '$p'"
done
[[ ${#lports[@]} -eq 1 || $kind == haproxy ]] || rig_die "several port pairs need haproxy (one process)"
lport=${lports[0]} sport=${sports[0]}
pidf=${6:-${RIG_RELAY_DIR:-/tmp}/rig-relay-$lport.pid}
mkdir -p "$(dirname "$pidf")"
log=${pidf%.pid}.log
rig_stop_pidfile "$pidf" "$RE" 1
for p in "${lports[@]}"; do
    if rig_listening "$p"; then
        echo "port $p is already in use:" >&2; rig_listener_info "$p" >&2; exit 1
    fi
done
# optional socket/userspace buffer sizes (see header)
rcvbuf=${RIG_RELAY_RCVBUF:-0} sndbuf=${RIG_RELAY_SNDBUF:-0} bufsize=${RIG_RELAY_BUFSIZE:-0}
for v in rcvbuf sndbuf bufsize; do
    [[ ${!v} =~ ^[0-9]+$ ]] || rig_die "RIG_RELAY_${v^^} must be a number of bytes, got '${!v}'"
done
bufmax() { sysctl -n "net.core.$1" 2>/dev/null || echo 0; }
if [[ $rcvbuf -gt 0 && $rcvbuf -gt $(bufmax rmem_max) ]]; then
    echo "warning: RIG_RELAY_RCVBUF=$rcvbuf > net.core.rmem_max=$(bufmax rmem_max): the kernel caps it" >&2
fi
if [[ $sndbuf -gt 0 && $sndbuf -gt $(bufmax wmem_max) ]]; then
    echo "warning: RIG_RELAY_SNDBUF=$sndbuf > net.core.wmem_max=$(bufmax wmem_max): the kernel caps it" >&2
fi
bufdesc=""
[[ $rcvbuf -gt 0 ]] && bufdesc+=" rcvbuf(server leg)=$rcvbuf"
[[ $sndbuf -gt 0 ]] && bufdesc+=" sndbuf(client leg)=$sndbuf"
[[ $bufsize -gt 0 ]] && bufdesc+=" bufsize=$bufsize"
case "$kind" in
socat)
    lopts="" copts="" sopts=()
    [[ $sndbuf -gt 0 ]] && lopts=",sndbuf=$sndbuf"
    [[ $rcvbuf -gt 0 ]] && copts=",rcvbuf=$rcvbuf"
    [[ $bufsize -gt 0 ]] && sopts=(-b "$bufsize")
    setsid socat -d "${sopts[@]}" "TCP-LISTEN:$lport,bind=$laddr,reuseaddr,fork$lopts" "TCP:$saddr:$sport$copts" \
        >"$log" 2>&1 </dev/null &
    echo $! >"$pidf"
    ;;
haproxy)
    cfg=${pidf%.pid}.cfg
    tune=""
    [[ $rcvbuf -gt 0 ]] && tune+="    tune.rcvbuf.server $rcvbuf"$'\n'
    [[ $sndbuf -gt 0 ]] && tune+="    tune.sndbuf.client $sndbuf"$'\n'
    [[ $bufsize -gt 0 ]] && tune+="    tune.bufsize $bufsize"$'\n'
    # nosplice + `no option splice-*`: bytes go through recv()/send() in
    # userspace, where an observer of haproxy's syscalls sees them (splice is
    # off by default in 2.6 too; this makes it explicit)
    # one frontend/backend pair per port pair; the first keeps the single-pair names
    proxies=""
    for i in "${!lports[@]}"; do
        sfx=""; [[ $i -gt 0 ]] && sfx="_${lports[$i]}"
        proxies+="frontend spice_in$sfx
    bind $laddr:${lports[$i]}
    default_backend spice_srv$sfx
backend spice_srv$sfx
    server spice $saddr:${sports[$i]}
"
    done
    cat >"$cfg" <<EOF
global
    maxconn 256
    nosplice
${tune}defaults
    mode tcp
    no option splice-auto
    no option splice-request
    no option splice-response
    timeout connect 5s
    timeout client 1h
    timeout server 1h
${proxies}
EOF
    setsid haproxy -db -f "$cfg" >"$log" 2>&1 </dev/null &
    echo $! >"$pidf"
    ;;
esac
pid=$(cat "$pidf")
all_listening() {
    local p
    for p in "${lports[@]}"; do rig_listening "$p" || return 1; done
}
for _ in $(seq 50); do
    all_listening && break
    rig_alive "$pid" || break
    sleep 0.1
done
if ! rig_alive "$pid" || ! all_listening; then
    echo "relay did not start:" >&2; cat "$log" >&2 || true
    rig_stop_pidfile "$pidf" "$RE" 1; exit 1
fi
for i in "${!lports[@]}"; do
    echo "$kind relay $laddr:${lports[$i]} -> $saddr:${sports[$i]} pid $pid ($pidf)${bufdesc}"
done
