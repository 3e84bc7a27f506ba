#!/bin/bash
# End-to-end smoke test of the rig (needs root and scripts/setup.sh done):
#
#   rig/smoke.sh [xspice] [veth] [tun] [qemu] [relaybuf] [auto] [tls] [stunnel2]
#                                                    # default: xspice veth tun
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
#   tls    : rig/tls-certs.sh + Xspice with only a TLS port; client.py with the CA
#            straight to it (every channel over TLS), then through rig/stunnel.sh
#            client (plain to stunnel, TLS to Xspice); checks main, display, inputs
#            and cursor opened, display traffic, 4 TLS connections to the port, and
#            that a client without the CA is refused (error-tls)
#   stunnel2 : spice-peer client -> stunnel client -> stunnel server -> spice-peer
#            server (needs $SPICE_PEER or target/release/spice-peer: cargo build
#            --release -p spice-observer --bin spice-peer); checks the peers' own
#            counts agree end to end and stunnel's "Connection closed" byte counts
#            equal them
# Ports 15905 (server), 16905 (relay), 15906 (qemu), 15907-15909 (stunnel2),
# display :15, state under
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
    "$HERE/stunnel.sh" stop "$D/stunnel-a.pid" >/dev/null 2>&1 || true
    "$HERE/stunnel.sh" stop "$D/stunnel-b.pid" >/dev/null 2>&1 || true
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

# "channel main-0 opened ..." lines of a client log, sorted: the channels that opened
opened() { grep -o '^channel [a-z]*-[0-9]* opened' "$1" | awk '{print $2}' | sort | tr '\n' ' '; }
summary_tls() { grep '^SUMMARY ' "$1" | sed 's/^SUMMARY //' | "$RIG_PY" -c 'import json,sys; print(json.load(sys.stdin)["tls"])'; }

t_tls() {
    "$HERE/tls-certs.sh" "$D/x509"
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" start $SP $DN --tls "$D/x509" -- --mode noise --fps 20 --size 128x96
    local ok=0 c n b want="cursor-0 display-0 inputs-0 main-0 "
    # straight to the TLS port
    "$HERE/client.py" "spice://127.0.0.1?tls-port=$SP" --ca-file "$D/x509/ca-cert.pem" \
        --seconds 3 --report 3 >"$D/client.log" 2>&1 &
    c=$!; sleep 1.5
    n=$(ss -Htn state established "sport = :$SP" | wc -l)
    wait $c || ok=1
    b=$(disp_bytes "$D/client.log")
    echo "direct TLS: opened $(opened "$D/client.log")| tls $(summary_tls "$D/client.log") | $n connections on :$SP | display bytes $b"
    [[ $(opened "$D/client.log") == "$want" && $(summary_tls "$D/client.log") == True && $n == 4 && $b -gt 500000 ]] || ok=1
    # without the CA: the server certificate does not verify
    if "$HERE/client.py" "spice://127.0.0.1?tls-port=$SP" --seconds 2 --report 3 >"$D/client-noca.log" 2>&1; then
        echo "a client without the CA connected"; ok=1
    else
        echo "without the CA: $(grep -o 'event error-tls' "$D/client-noca.log" | head -1)"
        grep -q 'event error-tls' "$D/client-noca.log" || ok=1
    fi
    # through stunnel: plain to stunnel, TLS from stunnel to Xspice
    "$HERE/stunnel.sh" client 127.0.0.1 $RP 127.0.0.1 $SP "$D/x509/ca-cert.pem" "$D/stunnel-a.pid"
    "$HERE/client.py" spice://127.0.0.1:$RP --seconds 3 --report 3 >"$D/client.log" 2>&1 &
    c=$!; sleep 1.5
    n=$(ss -Htnp state established "dport = :$SP" | grep -c stunnel4 || true)
    wait $c || ok=1
    b=$(disp_bytes "$D/client.log")
    echo "via stunnel: opened $(opened "$D/client.log")| tls $(summary_tls "$D/client.log") | stunnel->:$SP $n TLS connections | display bytes $b"
    [[ $(opened "$D/client.log") == "$want" && $(summary_tls "$D/client.log") == False && $n == 4 && $b -gt 500000 ]] || ok=1
    "$HERE/stunnel.sh" stop "$D/stunnel-a.pid"
    RIG_RUN=$D/xspice "$HERE/start-xspice.sh" stop $SP
    return $ok
}

t_stunnel2() {
    local peer=${SPICE_PEER:-$HERE/../target/release/spice-peer}
    [[ -x $peer ]] || { echo "no spice-peer at $peer (set SPICE_PEER)"; return 1; }
    "$HERE/tls-certs.sh" "$D/x509"
    "$peer" server --listen 127.0.0.1:15907 --set-ack --window 20 --messages 300 --body-size 20000 \
        --timeout-ms 10000 >"$D/peer-server.log" &
    local s=$!
    "$HERE/stunnel.sh" server 127.0.0.1 15908 127.0.0.1 15907 "$D/x509" "$D/stunnel-b.pid"
    "$HERE/stunnel.sh" client 127.0.0.1 15909 127.0.0.1 15908 "$D/x509/ca-cert.pem" "$D/stunnel-a.pid"
    "$peer" client --connect 127.0.0.1:15909 --messages 40 --timeout-ms 10000 >"$D/peer-client.log"
    wait $s
    "$HERE/stunnel.sh" stop "$D/stunnel-a.pid"; "$HERE/stunnel.sh" stop "$D/stunnel-b.pid"
    # sent/received bytes and messages of both peers, stunnel's byte counts
    local counts
    counts=$(cat "$D/peer-server.log" "$D/peer-client.log" | grep '^SUMMARY ' | sed 's/^SUMMARY //' |
        "$RIG_PY" -c 'import json,sys
s, c = [json.loads(l) for l in sys.stdin]
print(s["sent"]["messages"], c["received"]["messages"], c["sent"]["messages"], s["received"]["messages"],
      s["sent"]["bytes"], c["received"]["bytes"], c["sent"]["bytes"], s["received"]["bytes"])')
    echo "peers: s2c messages sent/received, c2s sent/received, then the same in bytes: $counts"
    local a b
    a=$(grep -o 'Connection closed: .*' "$D/stunnel-a.log" | tail -1)
    b=$(grep -o 'Connection closed: .*' "$D/stunnel-b.log" | tail -1)
    echo "stunnel client: $a"; echo "stunnel server: $b"
    read -r ms mr cs cr bs br bcs bcr <<<"$counts"
    [[ $ms == "$mr" && $cs == "$cr" && $bs == "$br" && $bcs == "$bcr" && $ms == 301 ]] &&
        [[ $a == "Connection closed: $bcs byte(s) sent to TLS, $bs byte(s) sent to socket" ]] &&
        [[ $b == "Connection closed: $bs byte(s) sent to TLS, $bcs byte(s) sent to socket" ]]
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
