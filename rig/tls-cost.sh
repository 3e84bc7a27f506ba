#!/bin/bash
# tls-cost.sh [MESSAGES] [REPEATS]: what the libssl hooks cost a TLS relay, measured in one
# run. spice-peer server -> stunnel B (server mode: TLS in, plain out) <- stunnel A (client
# mode: plain in, TLS out) <- spice-peer client, MESSAGES 200-byte messages under W = 20;
# the plaintext crosses SSL_write in A and SSL_read in B (and the ACKs the other way).
# Alternates, REPEATS times each:
#   off      no observer
#   nohooks  `observe --pid A --pid B --no-tls-hooks` (plain path only: the TLS sockets are
#            judged `unparsed: tls` on their first bytes and cost a few tracepoint runs)
#   hooks    `observe --pid A --pid B` (libssl uprobes: every message framed)
# and prints per run: wall time, stunnel A+B CPU per message (utime+stime from /proc), and,
# for `hooks`, run time per run of each spice_* program (bpf_stats, on meanwhile) and
# libssl calls per message. The difference hooks − nohooks is what the uprobes add (the trap
# into the kernel and back on entry and return, which bpf_stats does not see, plus the
# programs). Needs root, stunnel4, bpftool; OBSERVER and SPICE_PEER default to
# target/release/{spice-observer,spice-peer}. Ports 17910-17912.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
N=${1:-100000}
R=${2:-3}
OBS=${OBSERVER:-$HERE/../target/release/spice-observer}
PEER=${SPICE_PEER:-$HERE/../target/release/spice-peer}
D=$(mktemp -d /tmp/tls-cost.XXXXXX)
old=$(sysctl -n kernel.bpf_stats_enabled)
cleanup() {
    sysctl -qw kernel.bpf_stats_enabled="$old"
    "$HERE/stunnel.sh" stop "$D/a.pid" >/dev/null 2>&1 || true
    "$HERE/stunnel.sh" stop "$D/b.pid" >/dev/null 2>&1 || true
    kill $(jobs -p) 2>/dev/null || true
}
trap cleanup EXIT
"$HERE/tls-certs.sh" "$D/x509" >/dev/null
"$HERE/stunnel.sh" server 127.0.0.1 17911 127.0.0.1 17910 "$D/x509" "$D/b.pid" >/dev/null
"$HERE/stunnel.sh" client 127.0.0.1 17912 127.0.0.1 17911 "$D/x509/ca-cert.pem" "$D/a.pid" >/dev/null
A=$(cat "$D/a.pid") B=$(cat "$D/b.pid")
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
prog_stats() {
    bpftool -j prog show | python3 -c '
import json, sys
for p in json.load(sys.stdin):
    n = p.get("name", "")
    if n.startswith("spice_"):
        # bpftool leaves both out while a program has not run yet.
        print(n, p.get("run_time_ns", 0), p.get("run_cnt", 0))'
}
run() {
    local mode=$1 obs=""
    case $mode in
    hooks) sysctl -qw kernel.bpf_stats_enabled=1
           "$OBS" observe --pid "$A" --pid "$B" --duration 0 --no-progress --json "$D/hooks.json" >/dev/null 2>"$D/obs.log" & obs=$! ;;
    nohooks) "$OBS" observe --pid "$A" --pid "$B" --duration 0 --no-progress --no-tls-hooks >/dev/null 2>"$D/obs.log" & obs=$! ;;
    esac
    if [[ -n $obs ]]; then
        for _ in $(seq 100); do grep -q "watching" "$D/obs.log" 2>/dev/null && break; sleep 0.1; done
    fi
    "$PEER" server --listen 127.0.0.1:17910 --messages "$N" --body-size 200 --set-ack --window 20 >"$D/server.out" 2>&1 &
    local srv=$!
    sleep 0.3
    local s0 c0 t0
    [[ $mode == hooks ]] && s0=$(prog_stats)
    c0=$(( $(cpu "$A") + $(cpu "$B") )); t0=$(date +%s.%N)
    "$PEER" client --connect 127.0.0.1:17912 >"$D/client.out" 2>&1 || true
    wait $srv || true
    local t1 c1 s1
    t1=$(date +%s.%N); c1=$(( $(cpu "$A") + $(cpu "$B") ))
    [[ $mode == hooks ]] && s1=$(prog_stats)
    grep -q '"messages":'"$((N + 1))" "$D/server.out" || echo "warning: the server did not send $N messages" >&2
    python3 -c "import sys; t=float(sys.argv[2])-float(sys.argv[1]); c=(int(sys.argv[4])-int(sys.argv[3]))/int(sys.argv[5]); n=int(sys.argv[6]); print(f'{sys.argv[7]:8} wall {t:6.2f} s   stunnel CPU {c:6.2f} s = {c/n*1e6:6.2f} us/message')" "$t0" "$t1" "$c0" "$c1" "$ticks" "$N" "$mode"
    if [[ $mode == hooks ]]; then
        join <(echo "$s0" | sort) <(echo "$s1" | sort) | while read -r name a0 n0 a1 n1; do
            local n=$((n1 - n0))
            [[ $n -gt 0 ]] || continue
            echo "           $name: $(( (a1 - a0) / n )) ns per run, $n runs ($(python3 -c "print(f'{$n/$N:.2f}')") per message)"
        done
        sysctl -qw kernel.bpf_stats_enabled=0
    fi
    if [[ -n $obs ]]; then kill -INT "$obs"; wait "$obs" || true; fi
}
for i in $(seq "$R"); do
    for mode in off nohooks hooks; do run $mode; done
done
