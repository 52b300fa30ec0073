"""density="auto": the rule (`AutoDensity`), its clock, the rung choice and its state.

Each step measures, per replica, the compute seconds t_c, the seconds t_m of
the previous step's chunk all-reduce and the bytes b it sent (see
`ChunkSparsity`); the figures ride in the step's control all-reduce, so
every replica picks the same rung from the same sums (`choose_rung`).
"""

import math
from typing import List, Sequence

import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.csc.density import DEFAULT_DENSITY, DensityRule

AUTO = "auto"
AUTO_LADDER = (1.0, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001)
"""The densities density="auto" chooses from (those above `min_density`, then `min_density`);
1.0 sends every chunk (a dense step)."""
# The floor's default is the convergence bound: the fixed default density, the sparsest
# that trains at models.train's defaults; the rule prices rungs by bytes only and knows nothing of
# convergence. Top-k with error feedback sends a chunk once its residual is among the k largest,
# so at density d every chunk can be sent within ceil(C / k) <= 1/d steps; a floor whose 1/d
# exceeds a run's sparse steps leaves residuals stale and trains worse (docs/benchmarks.md).
DEFAULT_MIN_DENSITY = DEFAULT_DENSITY
"""`AutoDensity(min_density=)` (`ChunkSparsity(min_density=)`): the floor of density="auto"."""
DEFAULT_AUTO_BUDGET = 0.05
"""`AutoDensity(budget=)` (`ChunkSparsity(auto_budget=)`): communication seconds allowed per compute second."""
# The figures each replica adds to the step's control all-reduce.
TIMING_FIGURES = ("compute_seconds", "comm_seconds", "comm_bytes")


def timestamp(replica: int, event: str) -> tf.Tensor:
    """CSCReducer's default clock: tf.timestamp() (float64 seconds since the epoch)."""
    del replica, event
    return tf.timestamp()


def choose_rung(compute_seconds, comm_seconds, comm_bytes, rung_bytes: Sequence[float],
                budget: float, latency_bytes: float = 0.0) -> tf.Tensor:
    """density="auto"'s rule: the rung whose predicted communication fits the budget.

    The measured seconds are shared out over the bytes sent plus `latency_bytes`, the
    bytes the link could have carried in the all-reduce's fixed latency: a rung is
    priced by what its own bytes add, t_m * bytes / (b + latency_bytes), so a
    latency-bound link can afford a denser rung than its bytes alone suggest.

    Args:
      compute_seconds: float32 scalar, mean compute seconds t_c of a step.
      comm_seconds: float32 scalar, mean seconds t_m the measured step spent
        communicating.
      comm_bytes: float32 scalar, bytes b that step sent.
      rung_bytes: bytes each rung sends per step, rungs from the largest
        density to the floor (non-increasing).
      budget: communication seconds allowed per compute second (> 0).
      latency_bytes: bytes, >= 0: `gf_tf.plan.latency_bytes` of the planner's measured
        costs (0.0, the default, prices by bytes alone).

    Returns:
      int32 scalar: the first (largest-density) rung i with
      t_m * rung_bytes[i] / (b + latency_bytes) <= budget * t_c (equality fits); the last rung
      (the floor) if none fits or nothing was measured (t_c, t_m or b not
      positive and finite). The same inputs give the same rung on every
      replica: decide on all-reduced figures only.
    """
    compute_seconds = tf.convert_to_tensor(compute_seconds, tf.float32)
    comm_seconds = tf.convert_to_tensor(comm_seconds, tf.float32)
    comm_bytes = tf.convert_to_tensor(comm_bytes, tf.float32)
    floor = len(rung_bytes) - 1
    predicted = comm_seconds * (tf.constant(rung_bytes, tf.float32) /
                                (comm_bytes + tf.constant(latency_bytes, tf.float32)))
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
         budget: float, latency_bytes: float) -> tf.Tensor:
    """int32 rung of `choose_rung` from the first served replica's all-reduced figures
    (their means: the same sums on every replica)."""
    mean = all_reduced_figures / num_replicas
    return choose_rung(mean[0], mean[1], mean[2], rung_bytes, budget, latency_bytes)


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


class AutoDensity(DensityRule):
    """density="auto": each sparse step takes one of `rungs()`, chosen by `choose_rung` from
    the previous step's timing, which rides in the step's control all-reduce (model:
    docs/csc.md, "density="auto"").

    Args:
      min_density (float): the floor, in (0, 1] (default DEFAULT_MIN_DENSITY, 0.01).
      budget (float): communication seconds allowed per compute second, > 0 and finite
        (default DEFAULT_AUTO_BUDGET, 0.05).

    Raises:
      ValueError: min_density or budget out of range (the message names
        `ChunkSparsity`'s argument: min_density, auto_budget).
    """
    value, code = AUTO, -1.0
    measures = True
    groupable = False   # the rule needs the whole step's timing: one barrier

    def __init__(self, min_density: float = DEFAULT_MIN_DENSITY,
                 budget: float = DEFAULT_AUTO_BUDGET):
        if isinstance(min_density, bool) or not (isinstance(min_density, (int, float))
                                                 and 0.0 < min_density <= 1.0):
            raise ValueError(f"min_density must be a fraction in (0, 1] (the floor of "
                             f"density=\"auto\"), got {min_density!r}")
        if isinstance(budget, bool) or not (isinstance(budget, (int, float))
                                            and 0.0 < budget < math.inf):
            raise ValueError(f"auto_budget must be a number > 0 (communication seconds per "
                             f"compute second), got {budget!r}")
        self.floor, self.budget = float(min_density), float(budget)

    def rungs(self):
        """AUTO_LADDER's entries above the floor, then the floor."""
        return tuple(d for d in AUTO_LADDER if d > self.floor) + (self.floor,)

    def candidates(self):
        """Every rung, with first_step None."""
        return tuple((None, d) for d in self.rungs())

    def config(self):
        """{"min_density": the floor, "auto_budget": the budget}."""
        return {"min_density": self.floor, "auto_budget": self.budget}

    def figures(self, shared, clock, grads, comm):
        """`figures` of the set's `AutoState`."""
        return figures(shared.auto, clock, grads, comm)

    def index(self, stage, current, plans, timing, comm, warmup_steps):
        """The warm-up's `stage`, then len(staged plans) + this step's `rung` (priced with
        the communicator's `latency_bytes`)."""
        staged = sum(plan.first_step is not None for plan in plans)
        chosen = rung(timing, comm.num_replicas,
                      [plan.sent_bytes for plan in plans if plan.first_step is None], self.budget,
                      comm.latency_bytes)
        return tf.where(current >= warmup_steps, staged + chosen, stage)

    def clocked(self, buffers, clock, comm):
        """`clocked`: the buffers wait for the "send" clock."""
        return clocked(buffers, clock, comm)

    def done_clocks(self, reduced, clock, comm):
        """`done_clocks`."""
        return done_clocks(reduced, clock, comm)

    def record(self, shared, comm, branch):
        """`record`s the branch's clocks and bytes in the set's `AutoState`."""
        record(shared.auto, comm, branch.started, branch.done, branch.sent_bytes)
