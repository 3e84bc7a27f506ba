#!/bin/bash
# agent-cost.sh observe|daemon [SECONDS] [SESSIONS] [INTERVAL_MS]: the agent's own CPU and
# memory while it watches SESSIONS paced SPICE sessions (default 60 s, 10 sessions, 1 ms
# between messages: ~900 messages/s each; 2 ms gives ~480/s). INTERVAL_MS 0: saturated
# sessions of $SATURATED_MSGS messages each (default 400000), measured from the clients'
# start until the servers are done plus 1 s (SECONDS is then the longest wait), the messages
# counted by the servers themselves. With $LOAD_PEER (a spice-peer with the `load` subcommand):
# `spice-peer load --sessions SESSIONS --rate $RATE` (default 635 messages/s per session) on
# port 17300 instead, wrapped by agentload.py (INTERVAL_MS is then ignored).
#
# rig/agentload.py starts SESSIONS `spice-peer server --set-ack --window 20 --interval-ms
# INTERVAL_MS` as children of one process (the observer's target, as qemu is); the agent
# (`spice-observer observe --pid <that process>`, or `spice-observer daemon` with a relay
# rule naming agentload and its own pin directory) starts before the clients connect, so
# every link phase is seen. Then, over SECONDS after a 3 s warm-up, once a second: the
# agent's utime+stime (/proc/PID/stat, all threads) and VmRSS. With `daemon`, /metrics is
# scraped every $SCRAPE_S seconds (default 15, 0 = never), as Prometheus would.
#
# Prints the agent's CPU share of one core over the window, its RSS first/max/last (MiB),
# and the messages the servers sent during the window (sum of bytes_acked of their sockets
# from `ss -ti`, / 206 bytes per message: 6-byte mini header + 200-byte body), i.e. the rate
# the agent handled. The per-second series goes to $OUT/series.txt ($OUT default
# /tmp/agent-cost.$MODE). Needs root; $OBS (default target/release/spice-observer) and
# $SPICE_PEER (default target/release/spice-peer) name the binaries. Fixed ports
# 17300.. (servers) and 19599 (the daemon's HTTP endpoint). Stops everything it started.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
MODE=${1:-}
[[ $MODE == observe || $MODE == daemon ]] || { sed -n '2,/^set /{/^#/p}' "$0"; exit 2; }
SECS=${2:-60}
N=${3:-10}
INTERVAL=${4:-1}
OBS=${OBS:-$HERE/../target/release/spice-observer}
export SPICE_PEER=${SPICE_PEER:-$HERE/../target/release/spice-peer}
SCRAPE_S=${SCRAPE_S:-15}
OUT=${OUT:-/tmp/agent-cost.$MODE}
BASE=17300
LISTEN=127.0.0.1:19599
PINS=/sys/fs/bpf/spice-observer-agentcost
MSG_BYTES=206
WARM=3
mkdir -p "$OUT"
rm -f "$OUT"/*
hz=$(getconf CLK_TCK)
pids=()
cleanup() {
    trap - EXIT INT TERM
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    # Bounded: a child that does not end within 10 s is killed.
    for _ in $(seq 100); do
        jobs -pr | grep -q . || break
        sleep 0.1
    done
    for p in $(jobs -pr); do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [[ $MODE == daemon ]]; then "$OBS" daemon --pin-dir "$PINS" --unpin >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
trap 'cleanup; exit 143' INT TERM
if ((INTERVAL == 0)); then
    msgs=${SATURATED_MSGS:-400000}
else
    # Enough messages per session to outlast the window at 1000 messages/s.
    msgs=$(( (SECS + WARM + 30) * 1000 / INTERVAL ))
fi
if [[ -n ${LOAD_PEER:-} ]]; then
    # spice-peer load (N sessions of one display channel on port BASE, RATE messages/s each,
    # its detached client process ACKing every 20), under agentload.py's wrapper.
    coproc SERVERS { exec "$HERE/agentload.py" wrap "$LOAD_PEER" load --sessions "$N" \
        --channels 1 --body-size 200 --rate "${RATE:-635}" --batch 1 --window 20 \
        --duration $((SECS + WARM + 10)) --port $BASE --hold 2>"$OUT/servers.err"; }
else
    coproc SERVERS { exec "$HERE/agentload.py" servers "$N" $BASE "$INTERVAL" "$msgs" 2>"$OUT/servers.err"; }
fi
srv=$SERVERS_PID
pids+=("$srv")
# Copies of the coprocess's pipes: bash closes its own when the coprocess exits.
exec {srvout}<&"${SERVERS[0]}" {srvin}>&"${SERVERS[1]}"
if [[ -n ${LOAD_PEER:-} ]]; then
    read -r word _ server _ client <&"$srvout" || { cat "$OUT/servers.err" >&2; exit 1; }
    [[ $word == hold ]] || { echo "spice-peer load did not start: $word" >&2; exit 1; }
    pids+=("$client")
    parent=$srv
else
    read -r word parent <&"$srvout" || { cat "$OUT/servers.err" >&2; exit 1; }
    [[ $word == pid && $parent == "$srv" ]] || { echo "agentload did not start: $word $parent" >&2; exit 1; }
fi

if [[ $MODE == observe ]]; then
    "$OBS" observe --pid "$parent" --duration $((SECS + WARM + 10)) --no-progress \
        --pin-dir /sys/fs/bpf/spice-observer-agentcost-none --json "$OUT/report.json" \
        >"$OUT/table.txt" 2>"$OUT/agent.log" &
    agent=$!
    pids+=("$agent")
    ready='watching pid'
else
    cat >"$OUT/config.toml" <<TOML
listen = "$LISTEN"
bpf_stats = false
[discovery]
qemu = false
xspice = false
relays = [{ name = "agentload" }]
TOML
    "$OBS" daemon --config "$OUT/config.toml" --pin-dir "$PINS" 2>"$OUT/agent.log" &
    agent=$!
    pids+=("$agent")
    ready="(pid $parent, "
fi
for _ in $(seq 200); do
    grep -Fq "$ready" "$OUT/agent.log" && break
    kill -0 "$agent" 2>/dev/null || { cat "$OUT/agent.log" >&2; exit 1; }
    sleep 0.1
done
grep -Fq "$ready" "$OUT/agent.log" || { echo "agent not ready:" >&2; cat "$OUT/agent.log" >&2; exit 1; }

echo "$agent" >"$OUT/agent.pid"
clients() {
    if [[ -n ${LOAD_PEER:-} ]]; then
        echo go >&"$srvin"
        return
    fi
    for i in $(seq 0 $((N - 1))); do
        "$SPICE_PEER" client --connect 127.0.0.1:$((BASE + i)) --timeout-ms 600000 >/dev/null 2>&1 &
        pids+=("$!")
    done
}

acked() {
    ss -tinH state established "( sport >= :$BASE and sport < :$((BASE + N)) )" |
        { grep -o 'bytes_acked:[0-9]*' || true; } | awk -F: '{s += $2} END {print s + 0}'
}
ticks() { sed 's/.*) //' "/proc/$agent/stat" | awk '{print $12 + $13}'; }
rss() { awk '/^VmRSS:/ {print $2}' "/proc/$agent/status"; }
# CPU time of the agent's live threads, ns (schedstat: exact, where stat counts clock ticks).
cpu_ns() { cat /proc/"$agent"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%.0f", s}'; }
# Context switches of all the agent's threads: how often it was woken.
switches() { cat /proc/"$agent"/task/*/status 2>/dev/null | awk '/ctxt_switches:/ {s += $2} END {print s + 0}'; }
if ((INTERVAL > 0)); then
    clients
    sleep $WARM
fi
b0=$(acked)
w0=$(switches)
c0=$(cpu_ns)
t0=$(ticks)
start=$(date +%s.%N)
: >"$OUT/series.txt"
if ((INTERVAL == 0)); then
    # Saturated: from the clients' start until the servers are done (their own count of the
    # messages sent), and one second more for the agent to apply the last records.
    clients
    sent=
    for i in $(seq "$SECS"); do
        if read -t 1 -r word count <&"$srvout" && [[ $word == messages_sent ]]; then
            sent=$count
            break
        fi
        echo "$i $(ticks) $(rss)" >>"$OUT/series.txt"
    done
    [[ -n $sent ]] || { echo "the servers did not finish within $SECS s" >&2; exit 1; }
    sleep 1
    echo "end $(ticks) $(rss)" >>"$OUT/series.txt"
else
    for i in $(seq "$SECS"); do
        sleep 1
        echo "$i $(ticks) $(rss)" >>"$OUT/series.txt"
        if [[ $MODE == daemon && $SCRAPE_S -gt 0 && $((i % SCRAPE_S)) -eq 0 ]]; then
            curl -sf "http://$LISTEN/metrics" >"$OUT/scrape.txt" || echo "scrape failed" >&2
        fi
    done
fi
t1=$(ticks)
c1=$(cpu_ns)
end=$(date +%s.%N)
w1=$(switches)
b1=$(acked)
if ((INTERVAL == 0)); then
    # The sockets are closed: the servers' own count instead of the TCP counters.
    b0=0
    b1=$((sent * MSG_BYTES))
fi
kill -0 "$agent" 2>/dev/null || { echo "the agent exited during the run" >&2; exit 1; }
awk -v t0="$t0" -v t1="$t1" -v hz="$hz" -v s0="$start" -v s1="$end" -v b0="$b0" -v b1="$b1" \
    -v mb=$MSG_BYTES -v n="$N" -v mode="$MODE" -v w0="$w0" -v w1="$w1" -v c0="$c0" -v c1="$c1" '
    { r[NR] = $3; if ($3 > max) max = $3 }
    END {
        secs = s1 - s0
        msgs = (b1 - b0) / mb
        cpu = (t1 - t0) / hz
        printf "%s: %d sessions, %.0f messages/s each (%.0f in all) over %.1f s\n", mode, n, msgs / secs / n, msgs / secs, secs
        printf "agent CPU %.3f s = %.2f%% of one core (%.2f us per message), %.0f context switches/s\n", cpu, 100 * cpu / secs, 1e6 * cpu / msgs, (w1 - w0) / secs
        printf "agent CPU by schedstat (live threads): %.3f%% of one core\n", 100 * (c1 - c0) / 1e9 / secs
        printf "agent RSS MiB first %.1f max %.1f last %.1f\n", r[1] / 1024, max / 1024, r[NR] / 1024
    }' "$OUT/series.txt"
