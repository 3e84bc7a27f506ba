#!/usr/bin/python3
"""agentload.py: paced SPICE sessions for measuring the agent's own cost (rig/agent-cost.sh).

  agentload.py servers N BASEPORT INTERVAL_MS MESSAGES [BODY_BYTES]
      starts N `spice-peer server` processes as children of this process (the observer's
      --pid target, as qemu is), on 127.0.0.1:BASEPORT+i, each with SET_ACK W=20 and
      --interval-ms INTERVAL_MS before every message; prints `pid PID` once all listen, then
      waits for them and prints `messages_sent TOTAL` (their SUMMARY counts).

The clients (`spice-peer client --connect 127.0.0.1:BASEPORT+i`) are started by the caller,
outside this process tree, as the VMs' clients are (rig/agent-cost.sh).
  agentload.py wrap CMD [ARGS...]
      runs CMD (e.g. `spice-peer load ... --hold`, whose client process detaches itself) as
      this process's child with the same stdin and stdout: a process the daemon's relay
      rule `name = "agentload"` finds, whose descendants are the load's server alone.

$SPICE_PEER names the spice-peer binary (default target/release/spice-peer next to rig/).
"""
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.environ.get("SPICE_PEER", os.path.join(HERE, "..", "target", "release", "spice-peer"))


CHILDREN = []


def stop(_sig, _frame):
    """SIGTERM: passes it on to the children this process started. The main flow, blocked in
    their wait or their output, then reaps them and ends. (Waiting here instead would
    deadlock: Popen.wait holds a lock the interrupted wait already holds, and the child would
    stay a zombie.)"""
    for p in CHILDREN:
        if p.poll() is None:
            p.terminate()


def summary(out):
    for line in out.splitlines():
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY "):])
    return None


def servers(n, base, interval, messages, body="200"):
    procs = [
        subprocess.Popen(
            [PEER, "server", "--listen", f"127.0.0.1:{base + i}", "--set-ack", "--window", "20",
             "--interval-ms", str(interval), "--messages", str(messages), "--body-size", body,
             "--timeout-ms", "600000"],
            stdout=subprocess.PIPE, text=True)
        for i in range(n)
    ]
    CHILDREN.extend(procs)
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("listening"):
            sys.exit(f"spice-peer server did not start: {line!r}")
    print("pid", os.getpid(), flush=True)
    total = 0
    for p in procs:
        s = summary(p.stdout.read())
        p.wait()
        total += s["sent"]["messages"] if s else 0
    print("messages_sent", total, flush=True)


def wrap(cmd):
    """Runs `cmd` as a child with this process's stdin and stdout, and exits with its status."""
    p = subprocess.Popen(cmd)
    CHILDREN.append(p)
    rc = p.wait()
    sys.exit(128 - rc if rc < 0 else rc)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop)
    if len(sys.argv) >= 6 and sys.argv[1] == "servers":
        servers(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "wrap":
        wrap(sys.argv[2:])
    else:
        sys.exit(__doc__)
