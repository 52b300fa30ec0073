"""Helpers that run inside a worker process: signals, lost-peer messages, the private-network hint.

`gf_tf.launch` (gf-tf-run) starts workers; this module is what a worker itself
calls (`python -m models.train` does). Its companion `gf_tf.watchdog` runs as
a separate process beside the worker, importing nothing of gf_tf or
TensorFlow, to do what the worker cannot while TensorFlow holds its GIL.
This module imports no TensorFlow either (`exit_together` imports it when called).
"""

import os
import re
import signal
import sys
import threading
from typing import Optional

from gf_tf import cluster as cluster_lib

# Set by gf-tf-run in the environment of the workers it runs in its private network namespace.
PRIVATE_NETWORK_ENV = "GF_TF_RUN_PRIVATE_NETWORK"
HOST_NETWORK_HINT = ("gf-tf-run -n runs the workers in a private network namespace with only loopback, "
                     "so they cannot reach the network: run jobs that need it (downloads) with "
                     "gf-tf-run -n N --host_network -- ...")


def in_private_network(environ=None) -> bool:
    """True in a worker that gf-tf-run runs in its private, loopback-only network namespace."""
    return (os.environ if environ is None else environ).get(PRIVATE_NETWORK_ENV) == "1"


def exit_on_signals(name: str, signals=(signal.SIGINT, signal.SIGTERM)) -> None:
    """Makes SIGINT/SIGTERM end this process at once with one line and exit code 128 + signal.

    A TensorFlow worker blocked in C++ (waiting for a peer, in a collective)
    never returns to Python, so Python's KeyboardInterrupt comes late or never,
    and TensorFlow's preemption notifier swallows SIGTERM. Here the signals
    are blocked in every thread and one daemon thread takes them with
    `sigwait`, prints `<name>: interrupted by SIGINT: stopping` to stderr and
    calls `os._exit` (no Python clean-up, no traceback).

    While TensorFlow holds the GIL (waiting for a missing peer) that thread
    cannot run either; a `gf_tf.watchdog` process in the same process group
    then prints the line and SIGKILLs this process after its grace period.

    Call it from the main thread before TensorFlow starts its threads (they
    inherit the blocked mask). Used by `python -m models.train`.
    """
    from gf_tf import watchdog  # pylint: disable=import-outside-toplevel
    watchdog.start("signals", name)
    wanted = set(signals)
    for sig in wanted:   # a thread started earlier may still take one: no KeyboardInterrupt then
        signal.signal(sig, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)

    def wait():
        sig = signal.sigwait(wanted)
        print(f"{name}: interrupted by {signal.Signals(sig).name}: stopping", file=sys.stderr, flush=True)
        os._exit(128 + sig)

    threading.Thread(target=wait, name="gf_tf.exit_on_signals", daemon=True).start()


_TASK_NAME = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
# TensorFlow's words when two workers issue different collectives under one instance key.
COLLECTIVE_MISMATCH = re.compile(r"Collective instance \d+ expected type \d+ and data_type \d+ "
                                 r"but got type \d+ and data_type \d+")
# TensorFlow errors that mean a peer is gone or a collective could not complete.
_PEER_ERRORS = ("UnavailableError", "DeadlineExceededError", "AbortedError", "CancelledError",
                "InternalError", "UnknownError")


def lost_worker_message(error: BaseException, tf_config_text: Optional[str] = None) -> Optional[str]:
    """One line naming the worker(s) this task lost, or None if `error` is not about a lost peer.

    The peers are the tasks the error's message (or its chained errors')
    names other than this task; a timed-out collective that names none gives a
    line saying a peer stopped answering. Workers that issued different
    collectives get a line saying so, and a `gf_tf.agreement.PeerMismatchError`
    in the chain gives its own words.

    Args:
      error: what `model.fit` (or any collective) raised: a TensorFlow
        UnavailableError, DeadlineExceededError, AbortedError, ... .
      tf_config_text: the TF_CONFIG of this task (default: the environment's).

    Returns:
      The line (without a trailing newline), or None.
    """
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    mismatch = [e for e in chain if type(e).__name__ == "PeerMismatchError"]
    if mismatch:   # gf_tf.agreement has worded it already
        return str(mismatch[0]).removeprefix("gf_tf: ")
    errors = [e for e in chain if type(e).__module__.startswith("tensorflow")
              and type(e).__name__ in _PEER_ERRORS]
    if not errors:
        return None
    try:
        cluster = cluster_lib.from_tf_config(tf_config_text or None)
    except ValueError:   # a message must not hide the error it explains
        cluster = cluster_lib.Cluster(spec={})
    me = (cluster.task_type, cluster.task_index)
    text = " ".join(str(e) for e in errors)
    peers = sorted({(job, int(i)) for job, i in _TASK_NAME.findall(text)} - {me})
    cause = f"{type(errors[0]).__name__}: {_reason(str(errors[0]))[:200]}"
    mismatch = COLLECTIVE_MISMATCH.search(text)
    if mismatch:
        return (f"the workers issued different collectives ({type(errors[0]).__name__}: "
                f"{mismatch.group(0)}): every worker must run the same program with the same "
                f"strategy and gf_tf settings; restart every worker")
    if not peers and "CoordinationService" in text and cluster.leader not in (None, me):
        peers = [cluster.leader]   # the coordination service (heartbeats, registration) lives on the leader
    if not peers:
        return (f"a collective failed, probably because a peer worker stopped or is unreachable ({cause}); "
                f"restart every worker of the job")
    names = ", ".join(f"{job} {i}" for job, i in peers)
    hint = ""
    if "CoordinationService/Heartbeat" in text:
        hint = ("; if it was still running, a slow or saturated link held its heartbeats back: "
                "raise gf_tf.MultiWorkerMirroredStrategy(heartbeat_timeout=...) "
                "(models.train --heartbeat_timeout)")
    return (f"lost {names}: it stopped or became unreachable ({cause}); the job cannot continue "
            f"without it: restart every worker (with --model_dir, training resumes from the last "
            f"epoch){hint}")


def exit_together(timeout_seconds: float = 300.0) -> bool:
    """Waits until every worker of the cluster reaches this call; call it last, before exiting.

    TensorFlow's coordination service (on the leader, worker 0 or the chief) takes a
    worker that has exited for a crashed one once its heartbeats stop (about 10 s), and a
    worker still running then (say, evaluating on its own) logs `BaseCollectiveExecutor::
    StartAbort UNAVAILABLE: ... tasks are unhealthy (stopped sending heartbeats)`, and its
    collectives would fail. After this barrier every worker exits within moments of the others.
    Used by `python -m models.train`; mirrors the shutdown barrier of TensorFlow's
    coordination agent.

    Args:
      timeout_seconds: how long to wait for the other workers, in seconds.

    Returns:
      True once every worker has arrived; False (having waited for nothing) without
      a coordination service: one worker, MirroredStrategy.

    Raises:
      tf.errors.OpError: TensorFlow's error when a peer is lost or does not arrive
        within `timeout_seconds` (`lost_worker_message` turns it into one line).
    """
    from gf_tf import tf_internal  # pylint: disable=import-outside-toplevel  (imports TensorFlow)
    return tf_internal.wait_at_coordination_barrier("gf_tf/exit_together", timeout_seconds)


def _reason(message: str) -> str:
    """The informative line of a TensorFlow error message (not "Graph execution error:" or a traceback)."""
    lines = [l.strip() for l in message.splitlines()
             if l.strip() and not l.startswith((" ", "\t", "File ")) and not l.strip().startswith(
                 ("Graph execution error", "Detected at node", "Additional GRPC", ":UNKNOWN", "[["))]
    return next((l for l in lines if "aborted" in l.lower() or "timed out" in l.lower()
                 or "deadline" in l.lower() or "heartbeat" in l.lower()), lines[0] if lines else "")
