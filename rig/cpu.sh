#!/bin/bash
# CPU use of whole processes (all threads) over an interval, from /proc/PID/stat
# (utime+stime, in clock ticks).  100% = one core.
#
#   rig/cpu.sh SECONDS PID [PID...]
# e.g. rig/cpu.sh 5 "$(cat /tmp/rig-xspice-5905/Xorg.pid)"
#
# Prints one line per PID: "PID COMM PERCENT%" ("gone" if it exited meanwhile).
# Starts nothing, keeps no state, so it has no stop command.
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
[[ $# -ge 2 ]] || { rig_usage; exit 2; }
secs=$1; shift
hz=$(getconf CLK_TCK)
declare -A t0
for p in "$@"; do
    [[ -r /proc/$p/stat ]] || rig_die "no process $p"
    # fields after the ")" of comm: utime is the 12th, stime the 13th
    t0[$p]=$(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12+$13}')
done
sleep "$secs"
for p in "$@"; do
    t1=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12+$13}' || true)
    [[ -n $t1 ]] || t1=${t0[$p]}
    printf '%-8s %-20s %6.1f%%\n' "$p" "$(cat "/proc/$p/comm" 2>/dev/null || echo gone)" \
        "$(awk -v a="${t0[$p]}" -v b="$t1" -v hz="$hz" -v s="$secs" 'BEGIN {print (b - a) * 100 / hz / s}')"
done
