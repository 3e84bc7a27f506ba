#!/bin/bash
# TCP relay ("SPICE proxy") between client and spice-server.  SPICE opens one
# TCP connection per channel (main, display, inputs, cursor, ...), all to the
# same port, so a plain per-connection TCP forwarder is enough: every accepted
# connection gets its own upstream connection.
#
#   rig/relay.sh socat   LISTEN_ADDR LISTEN_PORT SERVER_ADDR SERVER_PORT [PIDFILE]
#   rig/relay.sh haproxy LISTEN_ADDR LISTEN_PORT SERVER_ADDR SERVER_PORT [PIDFILE]
#   rig/relay.sh stop    PIDFILE
#   rig/relay.sh status  PIDFILE
# e.g.
#   rig/relay.sh socat 127.0.0.1 6905 127.0.0.1 5905 /tmp/t1/relay.pid
#   rig/relay.sh socat 198.18.0.1 6905 127.0.0.1 5905   # client side of rig/shape.sh
#   rig/relay.sh stop /tmp/t1/relay.pid
#
# PIDFILE defaults to $RIG_RELAY_DIR/rig-relay-LISTEN_PORT.pid (RIG_RELAY_DIR
# default /tmp); its directory is created.  Next to it: NAME.log (and NAME.cfg
# for haproxy).  The PID is the listening process, started with setsid, so it
# leads a process group:
#   socat   : TCP-LISTEN,fork: one forked child per connection, in that group;
#             `stop` signals the whole group.  Default 8 KiB per read (-b).
#   haproxy : 2.6, mode tcp, one process (-db: foreground, no daemon fork);
#             timeouts 1 h so idle SPICE channels (inputs, cursor) are not cut.
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
pidf=${6:-${RIG_RELAY_DIR:-/tmp}/rig-relay-$lport.pid}
mkdir -p "$(dirname "$pidf")"
log=${pidf%.pid}.log
rig_stop_pidfile "$pidf" "$RE" 1
if rig_listening "$lport"; then
    echo "port $lport is already in use:" >&2; rig_listener_info "$lport" >&2; exit 1
fi
case "$kind" in
socat)
    setsid socat -d "TCP-LISTEN:$lport,bind=$laddr,reuseaddr,fork" "TCP:$saddr:$sport" \
        >"$log" 2>&1 </dev/null &
    echo $! >"$pidf"
    ;;
haproxy)
    cfg=${pidf%.pid}.cfg
    cat >"$cfg" <<EOF
global
    maxconn 256
defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h
frontend spice_in
    bind $laddr:$lport
    default_backend spice_srv
backend spice_srv
    server spice $saddr:$sport
EOF
    setsid haproxy -db -f "$cfg" >"$log" 2>&1 </dev/null &
    echo $! >"$pidf"
    ;;
esac
pid=$(cat "$pidf")
for _ in $(seq 50); do
    rig_listening "$lport" && break
    rig_alive "$pid" || break
    sleep 0.1
done
if ! rig_alive "$pid" || ! rig_listening "$lport"; then
    echo "relay did not start:" >&2; cat "$log" >&2 || true
    rig_stop_pidfile "$pidf" "$RE" 1; exit 1
fi
echo "$kind relay $laddr:$lport -> $saddr:$sport pid $pid ($pidf)"
