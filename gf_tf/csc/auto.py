"""density="auto": the rule (`AutoDensity`), its clock, the rung choice and its state.

Each step measures, per replica, the compute seconds t_c, the seconds t_m of
the previous step's chunk all-reduce, the bytes b it sent and the L1 norm of
its gradients (see `ChunkSparsity`); the figures ride in the step's control
all-reduce, so every replica picks the same rung from the same sums: the
link's price (`choose_rung`) and the accuracy guard (`regime_update`, the
critical-regime test of Accordion, Agarwal et al., MLSys 2021).
"""

import math
from typing import List, Sequence

import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.checks import is_int_at_least, is_number_in
from gf_tf.csc.density import MIN_CHUNKS, DensityRule

AUTO = "auto"
AUTO_LADDER = (1.0, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001)
"""The densities density="auto" chooses from (those above `min_density`, then `min_density`);
1.0 sends every chunk (a dense step)."""
# The floor's default bounds staleness: the sparsest fixed density that trains models.train's
# digits CNN as well as dense float32 (docs/benchmarks.md). Top-k with error feedback sends a
# chunk once its residual is among the k largest, so at density d every chunk can be sent within
# ceil(C / k) <= 1/d steps; a floor whose 1/d exceeds a run's sparse steps leaves residuals stale.
DEFAULT_MIN_DENSITY = 0.01
"""`AutoDensity(min_density=)` (`ChunkSparsity(min_density=)`): the floor of density="auto"."""
DEFAULT_AUTO_BUDGET = 0.05
"""`AutoDensity(budget=)` (`ChunkSparsity(auto_budget=)`): communication seconds allowed per compute second."""
# Error feedback delays part of every step's gradient, so a sparse step must be clearly
# faster than a dense one to reach an accuracy sooner: 1 / (1 - 0.25) = 1.33x at least.
DEFAULT_MIN_SAVING = 0.25
"""`AutoDensity(min_saving=)`: a sparse rung is taken only if it cuts the predicted step time
(compute + communication) of a dense step by at least this fraction."""
DEFAULT_REGIME_WINDOW = 20
"""`AutoDensity(regime_window=)`: steps per window of the critical-regime test (0: no test)."""
DEFAULT_REGIME_CHANGE = 0.2
"""`AutoDensity(regime_change=)`: relative change of the mean gradient L1 norm between two
windows that marks a critical regime (dense steps)."""
# The figures each replica adds to the step's control all-reduce.
TIMING_FIGURES = ("compute_seconds", "comm_seconds", "comm_bytes", "gradient_l1")


def timestamp(replica: int, event: str) -> tf.Tensor:
    """CSCReducer's default clock: tf.timestamp() (float64 seconds since the epoch)."""
    del replica, event
    return tf.timestamp()


def choose_rung(compute_seconds, comm_seconds, comm_bytes, rung_bytes: Sequence[float],
                budget: float, latency_bytes: float = 0.0, min_saving: float = 0.0) -> tf.Tensor:
    """density="auto"'s price rule: the rung whose predicted communication fits the budget,
    if compressing saves enough of the step.

    The measured seconds are shared out over the bytes sent plus `latency_bytes`, the
    bytes the link could have carried in the all-reduce's fixed latency: a rung is
    priced by what its own bytes add, c_i = t_m * bytes_i / (b + latency_bytes), so a
    latency-bound link can afford a denser rung than its bytes alone suggest.

    Args:
      compute_seconds: float32 scalar, mean compute seconds t_c of a step.
      comm_seconds: float32 scalar, mean seconds t_m the measured step spent
        communicating.
      comm_bytes: float32 scalar, bytes b that step sent.
      rung_bytes: bytes each rung sends per step, rungs from the largest
        density (rung 0, a dense step) to the floor (non-increasing).
      budget: communication seconds allowed per compute second (> 0).
      latency_bytes: bytes, >= 0: `gf_tf.plan.latency_bytes` of the planner's measured
        costs (0.0, the default, prices by bytes alone).
      min_saving: fraction in [0, 1): a sparse rung i is taken only if c_0 - c_i >=
        min_saving * (t_c + c_0), i.e. it makes a dense step's predicted time at least
        that much shorter; otherwise rung 0.

    Returns:
      int32 scalar: the first (largest-density) rung i with c_i <= budget * t_c (equality
      fits), or the last rung (the floor) if none fits; rung 0 (dense) instead when that
      rung saves less than `min_saving` of the dense step; the floor if nothing was
      measured (t_c, t_m or b not positive and finite; `AutoDensity`'s critical-regime test
      keeps the first steps dense, so they are measured). The same inputs give the same
      rung on every replica: decide on all-reduced figures only.
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
    saving = predicted[0] - tf.gather(predicted, first)
    pays = saving >= min_saving * (compute_seconds + predicted[0])
    chosen = tf.where(pays, first, tf.constant(0, tf.int32))
    return tf.where(measured, chosen, tf.constant(floor, tf.int32))


def regime_update(regime: tf.Tensor, gradient_l1, window: int, change: float) -> tf.Tensor:
    """One step of the critical-regime test (Accordion, Agarwal et al., MLSys 2021, which
    compares the gradient norm across epochs; here across windows of steps).

    Args:
      regime: float64 [4]: the sum of the gradient L1 norms in the current window, the
        window's steps so far, the previous window's mean (0: none yet), and 1.0 while
        critical (the initial state is critical: [0, 0, 0, 1]).
      gradient_l1: float32 scalar, this step's all-reduced gradient L1 norm (a step whose
        norm is not finite leaves the state as it is: an overflowed step teaches nothing).
      window: steps per window, >= 1.
      change: relative change of the window mean, > 0.

    Returns:
      float64 [4], the next state: when this step completes a window, critical = 1.0 if
      |mean - previous mean| >= change * previous mean or there was no previous mean, else
      0.0, and the window restarts; otherwise the same flag. Identical on every replica
      when fed all-reduced figures.
    """
    g = tf.cast(gradient_l1, tf.float64)
    total, steps = regime[0] + g, regime[1] + 1.0
    previous, critical = regime[2], regime[3]
    mean = total / steps
    full = steps >= window
    changed = (previous <= 0.0) | (tf.abs(mean - previous) >= change * previous)
    after = tf.where(full, tf.stack([0.0, 0.0, mean, tf.cast(changed, tf.float64)]),
                     tf.stack([total, steps, previous, critical]))
    return tf.where(tf.math.is_finite(g), after, regime)


class AutoState(tf.Module):
    """density="auto"'s state of one variable set: plain local variables on the host.

    started, done: per local replica, float64 seconds (clock time) when its
      last step's chunk all-reduce started and ended (0: nothing measured yet).
    sent: per local replica, float32 bytes its last step sent.
    regime: float64 [4], the critical-regime test's state (`regime_update`), the same on
      every replica of every worker.
    The timing is not checkpointed (a restored run measures again); the regime is.
    """

    def __init__(self, name: str, num_replicas: int):
        super().__init__(name=None)
        self.started, self.done, self.sent = (
            [tf_internal.local_variable(tf.constant(0.0, dtype), "/cpu:0", f"gf_{what}_{name}_r{r}")
             for r in range(num_replicas)]
            for what, dtype in (("started", tf.float64), ("done", tf.float64),
                                ("sent", tf.float32)))
        self.regime = tf_internal.local_variable(tf.constant(INITIAL_REGIME, tf.float64), "/cpu:0",
                                                 f"gf_regime_{name}")

    def to_arrays(self):
        """{"auto_regime": float64 [4]}."""
        return {REGIME_KEY: self.regime.numpy()}

    def to_tensors(self):
        """`to_arrays` as tensors read from the variable."""
        return {REGIME_KEY: self.regime.read_value()}

    def assign_arrays(self, arrays) -> None:
        """Restores the regime; a checkpoint without one (another density rule) starts critical."""
        self.regime.assign(arrays.get(REGIME_KEY, INITIAL_REGIME))


INITIAL_REGIME = (0.0, 0.0, 0.0, 1.0)
REGIME_KEY = "auto_regime"


def figures(state: AutoState, clock, grads, comm, gradient_l1: bool = True) -> List[tf.Tensor]:
    """Per served replica float32 [4]: this step's compute seconds, the previous step's
    communication seconds and bytes (zeros before the first measurement), and the L1 norm of
    this step's gradients (0 without `gradient_l1`: no regime test reads it).

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
            timing = tf.where(done > 0.0, measured, tf.zeros_like(measured))
        with tf.device(tensors[0].device if tensors else "/cpu:0"):
            l1 = tf.add_n([tf.reduce_sum(tf.abs(tf.cast(t, tf.float32)))
                           for t in (tensors if gradient_l1 else [])] or [tf.constant(0.0)])
        with tf.device("/cpu:0"):
            vectors.append(tf.concat([timing, [l1]], 0))
    return vectors


def rung(all_reduced_figures: tf.Tensor, num_replicas: int, rung_bytes: Sequence[int],
         budget: float, latency_bytes: float, min_saving: float) -> tf.Tensor:
    """int32 rung of `choose_rung` from the first served replica's all-reduced figures
    (their means: the same sums on every replica)."""
    mean = all_reduced_figures / num_replicas
    return choose_rung(mean[0], mean[1], mean[2], rung_bytes, budget, latency_bytes, min_saving)


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
    """density="auto": each step after the warm-up takes one of `rungs()` (rung 0 is a dense
    step): dense while the gradient is in a critical regime (`regime_update`), else the rung
    `choose_rung` prices from the previous step's timing. Both read figures that ride in the
    step's control all-reduce, so every replica picks the same rung (model, sources and
    measurements: docs/csc.md, "density="auto"").

    Args:
      min_density (float): the floor, in (0, 1] (default DEFAULT_MIN_DENSITY, 0.01).
      budget (float): communication seconds allowed per compute second, > 0 and finite
        (default DEFAULT_AUTO_BUDGET, 0.05).
      min_saving (float): in [0, 1): compress only when a sparse rung cuts the predicted
        time of a dense step by at least this fraction (default DEFAULT_MIN_SAVING, 0.25).
      min_chunks (int): >= 1: a rung sends at least this many chunks of each pack (all of a
        smaller pack), however low its density (default MIN_CHUNKS, 8).
      regime_window (int): steps per window of the critical-regime test, >= 0; 0 turns the
        test off (default DEFAULT_REGIME_WINDOW, 20).
      regime_change (float): > 0: a window whose mean gradient L1 norm differs from the
        previous window's by at least this fraction of it starts a critical regime: the
        next window's steps are dense (default DEFAULT_REGIME_CHANGE, 0.2). Until two
        windows have been compared the regime is critical.

    Raises:
      ValueError: an argument out of range (the message names `ChunkSparsity`'s argument
        for min_density and auto_budget, this class's for the others).
    """
    value, code = AUTO, -1.0
    measures = True
    groupable = False   # the rule needs the whole step's timing: one barrier

    def __init__(self, min_density: float = DEFAULT_MIN_DENSITY,
                 budget: float = DEFAULT_AUTO_BUDGET, min_saving: float = DEFAULT_MIN_SAVING,
                 regime_window: int = DEFAULT_REGIME_WINDOW,
                 regime_change: float = DEFAULT_REGIME_CHANGE, min_chunks: int = MIN_CHUNKS):
        if not is_number_in(min_density, 0.0, 1.0, low_open=True):
            raise ValueError(f"min_density must be a fraction in (0, 1] (the floor of "
                             f"density=\"auto\"), got {min_density!r}")
        if not is_number_in(budget, 0.0, math.inf, low_open=True, high_open=True):
            raise ValueError(f"auto_budget must be a number > 0 (communication seconds per "
                             f"compute second), got {budget!r}")
        if not is_number_in(min_saving, 0.0, 1.0, high_open=True):
            raise ValueError(f"min_saving must be a fraction in [0, 1) of a dense step's "
                             f"time, got {min_saving!r}")
        if not is_int_at_least(regime_window, 0):
            raise ValueError(f"regime_window must be an int >= 0 (steps; 0: no critical-regime "
                             f"test), got {regime_window!r}")
        if not is_number_in(regime_change, 0.0, math.inf, low_open=True, high_open=True):
            raise ValueError(f"regime_change must be a number > 0 (a relative change), got "
                             f"{regime_change!r}")
        if not is_int_at_least(min_chunks, 1):
            raise ValueError(f"min_chunks must be an int >= 1 (chunks of a pack per step), got "
                             f"{min_chunks!r}")
        self.floor, self.budget = float(min_density), float(budget)
        self.min_saving, self.regime_window = float(min_saving), int(regime_window)
        self.regime_change, self.min_chunks = float(regime_change), int(min_chunks)

    def rungs(self):
        """AUTO_LADDER's entries above the floor, then the floor."""
        return tuple(d for d in AUTO_LADDER if d > self.floor) + (self.floor,)

    def candidates(self):
        """Every rung, with first_step None."""
        return tuple((None, d) for d in self.rungs())

    def config(self):
        """{"min_density": the floor, "auto_budget": the budget}, and the other settings
        where they differ from their defaults."""
        extra = {key: value for key, value, default in (
            ("min_saving", self.min_saving, DEFAULT_MIN_SAVING),
            ("regime_window", self.regime_window, DEFAULT_REGIME_WINDOW),
            ("regime_change", self.regime_change, DEFAULT_REGIME_CHANGE),
            ("min_chunks", self.min_chunks, MIN_CHUNKS)) if value != default}
        return {"min_density": self.floor, "auto_budget": self.budget, **extra}

    def figures(self, shared, clock, grads, comm):
        """`figures` of the set's `AutoState`."""
        return figures(shared.auto, clock, grads, comm, gradient_l1=self.regime_window > 0)

    def index(self, stage, current, plans, timing, comm, warmup_steps, shared):
        """The warm-up's `stage`; after it, len(staged plans) + 0 (dense) while the regime is
        critical, else this step's `rung` (priced with the communicator's `latency_bytes`).
        Updates the set's regime with this step's gradient norm (warm-up steps included)."""
        staged = sum(plan.first_step is not None for plan in plans)
        chosen = rung(timing, comm.num_replicas,
                      [plan.sent_bytes for plan in plans if plan.first_step is None], self.budget,
                      comm.latency_bytes, self.min_saving)
        if self.regime_window:
            regime = shared.auto.regime.assign(regime_update(
                shared.auto.regime, timing[3] / comm.num_replicas, self.regime_window,
                self.regime_change))
            chosen = tf.where(regime[3] > 0.0, tf.constant(0, tf.int32), chosen)
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

