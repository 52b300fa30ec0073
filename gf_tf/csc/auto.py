"""density="auto": the clock, the rung rule and their state per variable set.

Each step measures, per replica, the compute seconds t_c, the seconds t_m of
the previous step's chunk all-reduce and the bytes b it sent (see
`ChunkSparsity`); the figures ride in the step's control all-reduce, so
every replica picks the same rung from the same sums (`choose_rung`).
"""

from typing import List, Sequence

import tensorflow as tf

from gf_tf import tf_internal

# The figures each replica adds to the step's control all-reduce.
TIMING_FIGURES = ("compute_seconds", "comm_seconds", "comm_bytes")


def timestamp(replica: int, event: str) -> tf.Tensor:
    """CSCReducer's default clock: tf.timestamp() (float64 seconds since the epoch)."""
    del replica, event
    return tf.timestamp()


def choose_rung(compute_seconds, comm_seconds, comm_bytes, rung_bytes: Sequence[float],
                budget: float) -> tf.Tensor:
    """density="auto"'s rule: the rung whose predicted communication fits the budget.

    Args:
      compute_seconds: float32 scalar, mean compute seconds t_c of a step.
      comm_seconds: float32 scalar, mean seconds t_m the measured step spent
        communicating.
      comm_bytes: float32 scalar, bytes b that step sent.
      rung_bytes: bytes each rung sends per step, rungs from the largest
        density to the floor (non-increasing).
      budget: communication seconds allowed per compute second (> 0).

    Returns:
      int32 scalar: the first (largest-density) rung i with
      t_m * rung_bytes[i] / b <= budget * t_c (equality fits); the last rung
      (the floor) if none fits or nothing was measured (t_c, t_m or b not
      positive and finite). The same inputs give the same rung on every
      replica: decide on all-reduced figures only.
    """
    compute_seconds = tf.convert_to_tensor(compute_seconds, tf.float32)
    comm_seconds = tf.convert_to_tensor(comm_seconds, tf.float32)
    comm_bytes = tf.convert_to_tensor(comm_bytes, tf.float32)
    floor = len(rung_bytes) - 1
    predicted = comm_seconds * (tf.constant(rung_bytes, tf.float32) / comm_bytes)
    fits = predicted <= budget * compute_seconds
    figures = tf.stack([compute_seconds, comm_seconds, comm_bytes])
    measured = tf.reduce_all(tf.math.is_finite(figures) & (figures > 0.0))
    first = tf.reduce_min(tf.where(fits, tf.range(len(rung_bytes)), floor))
    return tf.where(measured, first, tf.constant(floor, tf.int32))


class AutoState(tf.Module):
    """density="auto"'s timing of one variable set: plain local variables on the host.

    started, done: per local replica, float64 seconds (clock time) when its
      last step's chunk all-reduce started and ended (0: nothing measured yet).
    sent: per local replica, float32 bytes its last step sent.
    Timing only: not checkpointed (a restored run starts at the floor).
    """

    def __init__(self, name: str, num_replicas: int):
        super().__init__(name=None)
        self.started, self.done, self.sent = (
            [tf_internal.local_variable(tf.constant(0.0, dtype), "/cpu:0", f"gf_{what}_{name}_r{r}")
             for r in range(num_replicas)]
            for what, dtype in (("started", tf.float64), ("done", tf.float64),
                                ("sent", tf.float32)))

    def to_arrays(self):
        """{}: the timing is not saved."""
        return {}

    def assign_arrays(self, arrays) -> None:
        """Nothing to restore (see to_arrays)."""
        del arrays


def figures(state: AutoState, clock, grads, comm) -> List[tf.Tensor]:
    """Per served replica float32 [3]: this step's compute seconds, the previous step's
    communication seconds and bytes (zeros before the first measurement).

    grads: per pack, per served replica its gradients. The clock reads
    "ready" once all of the replica's gradients exist; the previous step's
    "send" and "done" were read when its chunk all-reduce started and ended,
    so the communication seconds leave out the local chunk path (accumulate,
    top-k, gather, scatter), which costs the same at every rung."""
    vectors = []
    for i, r in enumerate(comm.replicas):
        tensors = [t for pack_grads in grads for t in pack_grads[i]]
        with tf.device("/cpu:0"):
            with tf.control_dependencies(tensors):
                ready = tf.cast(clock(r, "ready"), tf.float64)
            done, started = state.done[r].read_value(), state.started[r].read_value()
            measured = tf.cast(tf.stack([ready - done, done - started,
                                         tf.cast(state.sent[r].read_value(), tf.float64)]),
                               tf.float32)
            vectors.append(tf.where(done > 0.0, measured, tf.zeros_like(measured)))
    return vectors


def rung(all_reduced_figures: tf.Tensor, num_replicas: int, rung_bytes: Sequence[int],
         budget: float) -> tf.Tensor:
    """int32 rung of `choose_rung` from the first served replica's all-reduced figures
    (their means: the same sums on every replica)."""
    mean = all_reduced_figures / num_replicas
    return choose_rung(mean[0], mean[1], mean[2], rung_bytes, budget)


def clocked(buffers: Sequence[tf.Tensor], clock, comm):
    """(buffers, per replica the "send" clock): the buffers wait for the clock, which waits
    for them, so the clock reads when the collective can start."""
    waiting, started = [], []
    for r, buffer in zip(comm.replicas, buffers):
        with tf.device("/cpu:0"), tf.control_dependencies([buffer]):
            started.append(tf.cast(clock(r, "send"), tf.float64))
        with tf.device(buffer.device), tf.control_dependencies([started[-1]]):
            waiting.append(tf.identity(buffer))
    return waiting, started


def done_clocks(reduced: Sequence[Sequence[tf.Tensor]], clock, comm) -> List[tf.Tensor]:
    """Per served replica the "done" clock, read once all its reduced buffers exist."""
    done = []
    for r, buffers in zip(comm.replicas, reduced):
        with tf.device("/cpu:0"), tf.control_dependencies(buffers):
            done.append(tf.cast(clock(r, "done"), tf.float64))
    return done


def record(state: AutoState, comm, started, done, sent_bytes) -> None:
    """Keeps this step's clocks and bytes for the next step's figures (run on the host)."""
    for r, t0, t1 in zip(comm.replicas, started, done):
        state.started[r].assign(t0)
        state.done[r].assign(t1)
        state.sent[r].assign(tf.cast(sent_bytes, tf.float32))
