"""A watchdog process that can end a worker blocked inside TensorFlow.

While TensorFlow 2.21 waits for a missing peer (strategy creation) the main
thread holds the GIL inside C++: no Python thread, timer or signal handler of
that process runs, and TensorFlow's preemption notifier swallows SIGTERM. A
small separate process (this file, run with the same Python, importing nothing
of TensorFlow) does what the worker cannot:

- `signals` mode: it sits in the worker's process group, so it gets the same
  SIGINT/SIGTERM (Ctrl-C, `gf-tf-run`'s stop, `kill -- -PGID`). It gives the
  worker GRACE seconds to stop by itself (`gf_tf.worker.exit_on_signals`),
  then prints the worker's one line and SIGKILLs it.
- `deadline` mode: unless stopped first (the cluster formed), it says which
  peers the worker waits for (their host:port does not answer) and until when,
  after NOTICE_AFTER seconds and then every NOTICE_EVERY seconds (TensorFlow's
  own "Waiting for 1/2 tasks" is an INFO line that gf-tf-run hides); after
  `seconds` (None: never) it prints a line naming them and SIGKILLs the worker.
  It ignores SIGINT/SIGTERM (the `signals` one handles them).

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
NOTICE_AFTER, NOTICE_EVERY = 10.0, 30.0   # seconds: when a waiting worker first says so, then how often
_POLL = 0.1


def start(mode: str, name: str, seconds=0.0, peers=(),
          notices=(NOTICE_AFTER, NOTICE_EVERY)) -> subprocess.Popen:
    """Starts a watchdog of this process.

    signals mode: `name` prefixes the interrupt line (e.g. "models.train").
    deadline mode: `name` is the worker ("worker 0"), `seconds` the deadline
    (None: none), `peers` the (label, "host:port") pairs to probe, `notices`
    (first, every) the seconds of its waiting lines.
    """
    spec = json.dumps({"mode": mode, "name": name, "seconds": seconds, "peers": list(peers),
                       "notices": list(notices)})
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


def _not_started(peers) -> str:
    missing = [f"{label} ({address})" for label, address in peers if not _answers(address)]
    return ', '.join(missing) or '(every port answers; a peer is stuck)'


def _waiting_line(spec: dict, started: float) -> str:
    waited = time.monotonic() - started
    if spec["seconds"] is None:
        limit = "no time limit (peer_startup_timeout None)"
    else:
        end = time.localtime(time.time() + spec["seconds"] - waited)
        limit = f"gives up at {time.strftime('%H:%M:%S', end)} (peer_startup_timeout {spec['seconds']:g} s)"
    return (f"gf_tf: {spec['name']}: waiting for peers to start: {_not_started(spec['peers'])}; "
            f"{waited:.0f} s so far, {limit}")


def _watch(parent: int, spec: dict) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # the worker blocks them
    got = []
    if spec["mode"] == "signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: got.append(s))
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    started = time.monotonic()
    deadline = None if spec["seconds"] is None else started + spec["seconds"]
    notice = started + spec["notices"][0]
    while os.getppid() == parent:
        if got:
            end = time.monotonic() + GRACE
            while os.getppid() == parent and time.monotonic() < end:
                time.sleep(_POLL)
            if os.getppid() == parent:
                _kill(parent, f"{spec['name']}: interrupted by {signal.Signals(got[0]).name}: stopping")
            return
        if spec["mode"] == "deadline" and deadline is not None and time.monotonic() >= deadline:
            _kill(parent, f"gf_tf: error: {spec['name']}: the cluster did not form within "
                          f"{spec['seconds']:g} s (peer_startup_timeout); not started: "
                          f"{_not_started(spec['peers'])}. Start every worker with the same TF_CONFIG "
                          f"cluster, or raise the timeout.")
            return
        if spec["mode"] == "deadline" and time.monotonic() >= notice:
            print(_waiting_line(spec, started), file=sys.stderr, flush=True)
            notice = time.monotonic() + spec["notices"][1]
        time.sleep(_POLL)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), json.loads(sys.argv[2]))
