"""A watchdog process that can end a worker blocked inside TensorFlow.

While TensorFlow 2.21 waits for a missing peer (strategy creation) the main
thread holds the GIL inside C++: no Python thread, timer or signal handler of
that process runs, and TensorFlow's preemption notifier swallows SIGTERM. A
small separate process (this file, run with the same Python, importing nothing
of TensorFlow) does what the worker cannot:

- `signals` mode: it sits in the worker's process group, so it gets the same
  SIGINT/SIGTERM (Ctrl-C, `gf-tf-run`'s stop, `kill -- -PGID`). It gives the
  worker GRACE seconds to stop by itself (`gf_tf.launch.exit_on_signals`),
  then prints the worker's one line and SIGKILLs it.
- `deadline` mode: unless stopped first (the cluster formed), after `seconds`
  it prints a line naming the peers whose host:port does not answer and
  SIGKILLs the worker. It ignores SIGINT/SIGTERM (the `signals` one handles them).

Either exits when the worker exits.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

GRACE = 1.5   # seconds the worker gets to stop by itself after a signal
_POLL = 0.1


def start(mode: str, name: str, seconds: float = 0.0, peers=()) -> subprocess.Popen:
    """Starts a watchdog of this process. `peers`: (label, "host:port") pairs to probe in deadline mode."""
    spec = json.dumps({"mode": mode, "name": name, "seconds": seconds, "peers": list(peers)})
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), spec],
                            stdin=subprocess.DEVNULL, close_fds=True)


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def _kill(parent: int, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch(parent: int, spec: dict) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # the worker blocks them
    got = []
    if spec["mode"] == "signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: got.append(s))
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    deadline = time.monotonic() + spec["seconds"]
    while os.getppid() == parent:
        if got:
            end = time.monotonic() + GRACE
            while os.getppid() == parent and time.monotonic() < end:
                time.sleep(_POLL)
            if os.getppid() == parent:
                _kill(parent, f"{spec['name']}: interrupted by {signal.Signals(got[0]).name}: stopping")
            return
        if spec["mode"] == "deadline" and time.monotonic() >= deadline:
            missing = [f"{label} ({address})" for label, address in spec["peers"] if not _answers(address)]
            _kill(parent, f"{spec['name']}: the cluster did not form within {spec['seconds']:g} s "
                          f"(peer_startup_timeout); not started: "
                          f"{', '.join(missing) or '(every port answers; a peer is stuck)'}. Start every "
                          f"worker with the same TF_CONFIG cluster, or raise the timeout.")
            return
        time.sleep(_POLL)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), json.loads(sys.argv[2]))
