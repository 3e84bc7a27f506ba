# shellcheck shell=bash
# Helpers shared by the rig's shell scripts (sourced, not run):
#   . "$(dirname "$(readlink -f "$0")")/lib.sh"
#
# Rules every rig script follows:
#  * a process is only ever stopped through a PID file that the rig wrote
#    when it started it, and only if /proc/PID/cmdline still matches what was
#    started (a recycled PID is left alone); never by name;
#  * stale state (PID file of a dead process, X lock of a dead server, a
#    leftover namespace or device) is cleaned when a new start needs the
#    resource; a live foreign owner is reported, never killed.

# shellcheck disable=SC2034
RIG_PY=/usr/bin/python3   # Debian's interpreter: has gi + Xlib (a pyenv python does not)

rig_die() { echo "${0##*/}: $*" >&2; exit 1; }

# rig_alive PID: the process exists and is not a zombie (PID 1 here reaps
# orphans late, so a killed daemon can linger as a zombie for a while)
rig_alive() {
    local st
    [[ ${1:-} =~ ^[0-9]+$ ]] || return 1
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

rig_cmdline() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null || true; }

# rig_pid_matches PID [REGEX]: PID alive and (no REGEX or its cmdline matches)
rig_pid_matches() {
    local pid=$1 re=${2:-}
    rig_alive "$pid" || return 1
    [[ -z $re ]] && return 0
    [[ $(rig_cmdline "$pid") =~ $re ]]
}

# rig_stop_pid PID [REGEX] [GROUP=0|1]: SIGTERM, wait up to 3 s, SIGKILL.
# GROUP=1 also signals the process group PID leads (the rig starts its
# daemons with setsid, so their children, e.g. socat's per-connection forks,
# are in that group).  SIGCONT first, in case a test SIGSTOPped it.
rig_stop_pid() {
    local pid=$1 re=${2:-} grp=${3:-0}
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    if rig_pid_matches "$pid" "$re"; then
        kill -CONT "$pid" 2>/dev/null || true
        kill -TERM "$pid" 2>/dev/null || true
    fi
    if [[ $grp == 1 ]]; then
        kill -CONT -- "-$pid" 2>/dev/null || true
        kill -TERM -- "-$pid" 2>/dev/null || true
    fi
    for _ in $(seq 30); do
        rig_alive "$pid" || break
        sleep 0.1
    done
    if rig_pid_matches "$pid" "$re"; then kill -KILL "$pid" 2>/dev/null || true; fi
    [[ $grp == 1 ]] && kill -KILL -- "-$pid" 2>/dev/null || true
    for _ in $(seq 20); do rig_alive "$pid" || return 0; sleep 0.05; done
    return 0
}

# rig_stop_pidfile FILE [REGEX] [GROUP]: stop what FILE names, remove FILE.
rig_stop_pidfile() {
    local f=$1 pid
    [[ -f $f ]] || return 0
    pid=$(tr -dc '0-9' <"$f")
    rig_stop_pid "$pid" "${2:-}" "${3:-0}"
    rm -f "$f"
}

# rig_listening PORT: some socket listens on TCP PORT (any address, root netns)
rig_listening() { ss -Hltn "sport = :$1" | grep -q .; }

# rig_listener_info PORT: who listens (for error messages)
rig_listener_info() { ss -Hltnp "sport = :$1" 2>/dev/null | head -3; }

# rig_usage: print the calling script's header comment (its usage)
rig_usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
