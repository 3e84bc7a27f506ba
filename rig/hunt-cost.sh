#!/bin/bash
# hunt-cost.sh [SECONDS] [OBSERVER]: kernel time per call of the capture programs while they
# hunt for SPICE message boundaries on a connection joined mid-stream that is not SPICE
# (iperf3 over loopback, 16 KiB writes). Starts iperf3, lets it run 1 s, starts
# `spice-observer observe --pid <iperf3 client>`, and prints run_time_ns / run_cnt of each
# spice_* program over the middle of the run (bpftool, kernel.bpf_stats_enabled=1 meanwhile).
# Needs root; OBSERVER defaults to target/release/spice-observer.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SECS=${1:-10}
OBS=${2:-$HERE/../target/release/spice-observer}
PORT=15299
prog_stats() {
    bpftool -j prog show | python3 -c '
import json, sys
for p in json.load(sys.stdin):
    n = p.get("name", "")
    if n.startswith("spice_") and "run_cnt" in p:
        print(n, p["run_time_ns"], p["run_cnt"])'
}
old=$(sysctl -n kernel.bpf_stats_enabled)
sysctl -qw kernel.bpf_stats_enabled=1
trap 'sysctl -qw kernel.bpf_stats_enabled=$old; kill $(jobs -p) 2>/dev/null || true' EXIT
iperf3 -s -p $PORT -1 >/dev/null 2>&1 &
sleep 0.5
iperf3 -c 127.0.0.1 -p $PORT -t $((SECS + 4)) -l 16K >/dev/null 2>&1 &
client=$!
sleep 1
"$OBS" observe --pid $client --duration "$SECS" --no-progress >/dev/null 2>&1 &
obs=$!
sleep $((SECS / 2))
a=$(prog_stats)
sleep 3
b=$(prog_stats)
wait $obs || true
join <(echo "$a" | sort) <(echo "$b" | sort) | while read -r name t0 c0 t1 c1; do
    n=$((c1 - c0))
    [ "$n" -gt 0 ] || continue
    echo "$name: $(( (t1 - t0) / n )) ns per run over $n runs"
done
