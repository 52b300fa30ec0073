"""A step's deadline: one watchdog thread per process in place of a timeout on every collective.

TensorFlow 2.21 starts one thread for every collective op that carries
`CommunicationOptions(timeout_seconds=T)`, and the thread sleeps the whole T seconds
however soon the collective completes (tensorflow/tensorflow#62466). A worker
then holds about (collectives per second) x T sleeping threads: at T = 300 s and a
small, fast model, tens of thousands, until the kernel refuses a new one
(`pid_max`) and the worker aborts (`std::system_error: Resource temporarily unavailable`).

The rule (`in_step_options`): inside a gradient all-reduce step no collective gf_tf
issues carries a timeout, whatever the options say; the step's deadline keeps T.
`StepWatch.begin` counts the step in once its gradients exist, `StepWatch.end`
counts it out once its reduced gradients exist, and one daemon thread per process
reads both counts every `poll_seconds(T)`. When a step stays in for T seconds while no
other step goes in or out (`Stall`), the thread aborts the process's collectives
(TF's `abort_collective_ops`, which MultiWorkerMirroredStrategy's own health check
calls) and the waiting collective raises `tf.errors.DeadlineExceededError` with
`timeout_message(T)`: a stuck or lost peer still ends the step within T plus one
poll, with one thread however many collectives a step issues.

Outside the step, collectives keep the options as given: the settings handshake,
the planner's probe and its trial run a fixed number of eager collectives per
variable set. The all-reduces gf_tf hands to TensorFlow untouched (metrics,
SyncBatchNorm statistics, users' own) keep the user's options, and with them one
sleeping thread per collective.
"""

import copy
import logging
import threading
import time
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from gf_tf import tf_internal

_log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
"""Seconds between two reads of the step counts (less for a timeout under 4 s)."""


def in_step_options(options):
    """The options a step's collectives run with: a copy of `options` (CommunicationOptions or
    None) with `timeout_seconds=0`, which TensorFlow merges over the strategy's own options as
    "no timeout" (the step's `StepWatch` keeps the deadline)."""
    options = copy.copy(options) if options is not None else (
        tf.distribute.experimental.CommunicationOptions())
    options.timeout_seconds = 0
    return options


def for_step(strategy: tf.distribute.Strategy, options=None):
    """(the options a step's collectives under `strategy` run with, the step's StepWatch or None):
    `in_step_options(options)`, and the process's StepWatch for the timeout the collectives would
    have carried (`options` over the strategy's `communication_options`), None where there is none.

    Call it while tracing the step; count the step in and out with the watch's `begin` and `end`.
    """
    timeout = tf_internal.collective_timeout(strategy, options)
    step_watch = watch(strategy.extended.worker_devices[0], timeout) if timeout > 0 else None
    return in_step_options(options), step_watch


def poll_seconds(timeout: float) -> float:
    """Seconds between two reads of the step counts for a deadline of `timeout` seconds."""
    return min(POLL_SECONDS, timeout / 4)


def timeout_message(timeout: float) -> str:
    """The message of the DeadlineExceededError a step that outlives its deadline raises."""
    return (f"gf_tf: a gradient all-reduce did not complete within {timeout:g} s "
            f"(CommunicationOptions(timeout_seconds={timeout:g})): a peer worker stopped, is stuck, "
            f"or issues other collectives. Collective has timed out during execution.")


class Stall:
    """When a step has been in for `timeout` seconds with no progress, from samples of the counts.

    `observe(now, entered, left)` takes the time (seconds) and the counts of steps
    counted in and out; it returns True once the same counts, with more in than out,
    have been seen for `timeout` seconds. Any change of the counts starts the wait anew.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._counts: Optional[Tuple[int, int]] = None
        self._since = 0.0

    def observe(self, now: float, entered: int, left: int) -> bool:
        counts = (int(entered), int(left))
        if counts != self._counts or entered <= left:
            self._counts, self._since = counts, now
            return False
        return now - self._since >= self.timeout


class StepWatch:
    """The counts of one process's gradient all-reduce steps under one deadline.

    Attributes:
      timeout: the deadline, seconds (> 0).
      counts: int64 [2] variable on the process's first replica device: steps counted
        in, steps counted out.
    """

    def __init__(self, device: str, timeout: float):
        self.timeout = timeout
        self.counts = tf_internal.local_variable(np.zeros([2], np.int64), device, "gf_step_deadline")

    def begin(self, tensors) -> None:
        """Counts a step in once every tensor of the nest `tensors` (the step's gradients) exists."""
        with tf.control_dependencies(_flat(tensors)):
            self.counts.assign_add(tf.constant([1, 0], tf.int64))

    def end(self, tensors) -> None:
        """Counts the step out once every tensor of the nest `tensors` (its results) exists."""
        with tf.control_dependencies(_flat(tensors)):
            self.counts.assign_add(tf.constant([0, 1], tf.int64))


def _flat(tensors):
    return [t for t in tf.nest.flatten(tensors, expand_composites=True) if t is not None]


_lock = threading.Lock()
_watches: Dict[Tuple[str, float], StepWatch] = {}
_thread: Optional[threading.Thread] = None


def watch(device: str, timeout: float) -> StepWatch:
    """The process's StepWatch for `timeout` seconds (> 0) on `device`, created (eagerly) on first
    use; the first one starts the watchdog thread."""
    global _thread
    with _lock:
        key = (device, float(timeout))
        if key not in _watches:
            _watches[key] = StepWatch(device, float(timeout))
        if _thread is None:
            _thread = threading.Thread(target=_watchdog, name="gf_tf.step_deadline", daemon=True)
            _thread.start()
        return _watches[key]


def _watchdog() -> None:
    stalls: Dict[Tuple[str, float], Stall] = {}
    while True:
        with _lock:
            watches = dict(_watches)
        for key, step_watch in watches.items():
            try:
                entered, left = step_watch.counts.numpy()
            except Exception:  # pylint: disable=broad-except  # the runtime is going away
                return
            if stalls.setdefault(key, Stall(step_watch.timeout)).observe(time.monotonic(),
                                                                          entered, left):
                message = timeout_message(step_watch.timeout)
                _log.error(message)
                tf_internal.abort_collectives(tf.errors.DEADLINE_EXCEEDED, message)
                return
        time.sleep(min(poll_seconds(w.timeout) for w in watches.values()))
