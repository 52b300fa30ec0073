"""Coarse-grained sparse communication (CSC): consistent top-k chunk all-reduce.

Source: GradientFlow (arXiv 1902.06855), "coarse-grained sparse
communication"; momentum correction and warm-up as in Deep Gradient
Compression (Lin et al., arXiv 1712.01887, sections 3.2 and 3.4).

Per pack of n float elements cut into C = ceil(n / chunk_size) chunks, per
local replica, one step:

  u   = momentum * u + g                   (only with momentum > 0)
  acc = residual + (u or g)                float32 [n]
  norms = L1 norm of each chunk of acc     float32 [C], all-reduced (SUM) in
                                           float32, so every replica on every
                                           worker sees the same vector
  idx = the k largest norms, ties to the lower chunk index, sorted ascending
  sel = chunks idx of acc, each prescaled on a float16 wire by a power of
        two chosen from its all-reduced L1 norm (which bounds every partial
        sum of the ring; see gf_tf.compression), cast to the wire dtype,
        zero-padded to k*chunk_size (a static shape)
  sel = all-reduce(sel)                    SUM over all N replicas
  out = sel postscaled (the inverse power of two) and scattered back into
        the pack's tensors, 0 elsewhere
  residual = acc with chunks idx set to 0  (assignment: error feedback)
  u   = u with chunks idx set to 0         (momentum factor masking)

A step whose all-reduced norms are not finite leaves residual and u as they
were (its output carries the inf/NaN so a loss-scale optimizer skips it).
Dense (warm-up) steps send every chunk the same way, without masking u.

The norms of all packs travel in the step's one control all-reduce
(`gf_tf.reducers`), and the selected chunks of all packs in one more: two
collectives per step, whatever the number of packs (one more per extra wire
dtype, e.g. bfloat16 gradients beside float32 ones).
With ChunkSparsity(density="auto") the step's control all-reduce also
carries 3 timing figures per replica, from whose sums every replica picks the
same density (`choose_rung`); see ChunkSparsity.
With ChunkSparsity(selection="global") the k largest norms are taken over the
chunks of all packs of one wire dtype at once (K = ceil(density * their total
chunks), a static wire length K*chunk_size); each pack then sends its share
of those K chunks, a number that changes from step to step.
State (`CSCState`) is per pack of one variable set, owned by
GradientFlowAllReduce's state for that variable set, never by this object.
"""

import logging
import math
from typing import Sequence, Tuple, Union

import tensorflow as tf

from gf_tf import compression as compression_lib
from gf_tf import ops, tf_internal
from gf_tf.reducers import Reducer, Sent

# Chosen with benchmarks/csc_defaults.py and benchmarks/convergence.py: at
# 1024 elements the norms cost 0.1% of the float32 bytes (15% of what a 1%
# step sends; 43% at 256), the 0.54M-parameter digits CNN still has 533 chunks,
# the selected chunks carry about as much of the accumulator's L1 mass per
# step as 16-256 element chunks (2.2% vs 2.3-2.8% at density 1%), and density
# 1% (151x fewer bytes) trains the digits CNN as well as dense float32.
DEFAULT_CHUNK_SIZE = 1024
DEFAULT_DENSITY = 0.01

# density="auto" (see ChunkSparsity): the densities it may choose (static k per pack per
# rung, so every rung's wire shape is static), its default floor and communication budget.
AUTO = "auto"
AUTO_LADDER = (0.25, 0.1, 0.03, 0.01, 0.003, 0.001)
# benchmarks/convergence.py (digits CNN, 10 epochs, 2 workers, momentum correction 0.9,
# 50 dense warm-up steps): dense float32 96.94%, CSC 10% 96.94%, 1% 97.22%, 0.1% 97.22%.
DEFAULT_MIN_DENSITY = 0.001
DEFAULT_AUTO_BUDGET = 0.05

WARMUP_MODES = ("dense", "exponential")
SELECTIONS = ("per_pack", "global")

_log = logging.getLogger(__name__)


def selected_chunk_count(num_chunks: int, density: float) -> int:
    """k = max(1, ceil(density * num_chunks)), at most num_chunks.

    The product is rounded to 9 decimals first so that e.g. 0.07 * 100
    (7.000000000000001 in binary floating point) gives 7, not 8.
    Returns 0 for a pack of 0 chunks.
    """
    if num_chunks <= 0:
        return 0
    return min(num_chunks, max(1, math.ceil(round(density * num_chunks, 9))))


def select_chunks(norms: tf.Tensor, k: int) -> tf.Tensor:
    """Indices of the `k` largest entries of `norms`, sorted ascending.

    Args:
      norms: float32 [C], identical on every replica (all-reduced).
      k: static number of chunks, 1 <= k <= C.

    Returns:
      int32 [k]. Equal norms go to the lower chunk index (tf.math.top_k is
      documented to put the lower index first among equal values); NaN ranks
      as +inf, so a non-finite chunk is always selected and visible in the
      output.
    """
    key = tf.where(tf.math.is_nan(norms), tf.constant(math.inf, norms.dtype), norms)
    _, indices = tf.math.top_k(key, k=k, sorted=True)
    return tf.sort(indices)


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


class ChunkSparsity:
    """CSC configuration and state, for `GradientFlowAllReduce(sparsity=...)`.

    Args:
      density: target fraction of chunks sent per step, in (0, 1]. k =
        max(1, ceil(density * num_chunks)) chunks of each pack are sent.
        1.0 means dense. Or "auto": the density follows the measured link
        (below).
      chunk_size: elements per chunk (>= 1). The chunk norms add 4 bytes per
        chunk_size elements to each step (1/chunk_size of the float32 bytes).
      warmup_steps: number of all-reduce steps (optimizer steps) at the start
        that use the warm-up schedule instead of `density`.
      momentum: momentum correction factor m in [0, 1). With m > 0 this object
        keeps the momentum u = m*u + g per replica and sends from
        residual + u, so the optimizer must be plain SGD WITHOUT momentum
        (e.g. keras.optimizers.SGD(learning_rate, momentum=0.0)) set to the
        learning rate you would use with momentum m (for a constant rate the
        dense steps then equal Keras's SGD with momentum m). With m = 0 it is
        plain error feedback and any optimizer can be used (momentum
        optimizers converge worse at low density: see DGC).
      warmup: the schedule during the first `warmup_steps` steps:
        "dense": every pack is all-reduced densely (wire dtype of the pack);
        "exponential": the warm-up is cut into equal stages of density
          0.25, 0.25/4, 0.25/16, ... (those above `density`), as in DGC's
          25% -> 6.25% -> 1.5625% -> 0.4% ramp.
        See `schedule()` and `density_at(step)`. Momentum correction needs
        a warm-up: on the digits CNN at density 1% (benchmarks/convergence.py)
        it diverged without one and with the exponential ramp from step 0,
        and matched dense float32 after 50 dense steps; plain error feedback
        (momentum=0) converged without warm-up.
      min_density: density="auto" only: the floor, in (0, 1]. The default
        0.001 comes from benchmarks/convergence.py (digits CNN, 10 epochs, 2
        workers, momentum correction 0.9, 50 dense warm-up steps): dense
        float32 96.94% test accuracy, dense FP16 97.78%, CSC 10% 96.94%,
        1% 97.22%, 0.1% 97.22%: no loss down to 0.1%. Raise it for models
        that lose accuracy there.
      auto_budget: density="auto" only: communication seconds allowed per
        second of compute, > 0 (default 0.05).

    density="auto": after the warm-up, each step picks one rung of
    `rungs()` (AUTO_LADDER = 0.25, 0.1, 0.03, 0.01, 0.003, 0.001 above
    `min_density`, then `min_density`); every rung has its own static k per
    pack, so wire shapes stay static and the rungs are branches of one
    `tf.switch_case`. Each step measures, per replica, with `tf.timestamp()`:
    t_c, the compute seconds (gradients ready minus the end of the previous
    step's communication) and t_m, the seconds of the chunk all-reduce (the
    local chunk path, which costs the same at every rung, is left out), with
    b, the bytes that step sent. The figures ride in the
    step's control all-reduce (3 float32 more, no extra collective), so every
    replica on every worker decides from the same sums with the same float32
    arithmetic and picks the same rung (`choose_rung`): predicting
    t(d) = t_m * bytes(d) / b, the largest d with t(d) <= auto_budget * t_c,
    else the floor; the floor when nothing was measured yet (the first step;
    dense warm-up steps measure too, so the first sparse step after a warm-up
    already decides on a measurement). CSC's collectives run after the last
    gradient of the step is ready (the norms decide which chunks to send), so
    they cannot hide behind backprop: "hides behind compute" is implemented as
    "costs at most auto_budget of the compute time", which keeps throughput
    within a factor 1 / (1 + auto_budget) (95% at 0.05) of a step without
    communication, hence of the fastest fixed density, while sending the most
    chunks the link affords. The decision follows the previous step's
    figures; a slow step (an evaluation between epochs) may give one step at a
    higher density. The chosen density is `GradientFlowStats`' `gf_density`.
      selection: which chunks compete for the k places:
        "per_pack": each pack sends its own top k = max(1, ceil(density *
          C_p)) of its C_p chunks (every pack is represented every step);
        "global": one top K = max(1, ceil(density * C)) over the C chunks of
          all packs of one wire dtype (the whole model in practice), the
          whole-model importance of GradientFlow's CSC; a pack may send none
          or all of its chunks on a step. Same bytes on the wire, same two
          collectives per step; ties go to the lower chunk index, counting
          through the packs in their all-reduce order.

    Raises:
      ValueError naming the argument when one is out of range.

    This object holds settings only. The state (`CSCState`: residuals,
    velocities, step counters) belongs to the variables whose gradients it
    holds: GradientFlowAllReduce keeps one per variable set (see
    `GradientFlowAllReduce.states()`), so two models or two optimizers under
    one strategy never share it. The state is saved with the optimizer's
    checkpoint (`gf_tf.checkpoint`: `model.save_weights`, `ModelCheckpoint`,
    `BackupAndRestore`), each worker its own; use
    `gf_tf.checkpoint.BackupAndRestore` with several workers.
    """

    def __init__(self, density: Union[float, str] = DEFAULT_DENSITY,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, warmup_steps: int = 0,
                 momentum: float = 0.0, warmup: str = "dense", selection: str = "per_pack",
                 min_density: float = DEFAULT_MIN_DENSITY,
                 auto_budget: float = DEFAULT_AUTO_BUDGET):
        if isinstance(density, str):
            if density != AUTO:
                raise ValueError(f"density must be a fraction in (0, 1] or \"auto\", got {density!r}")
        elif isinstance(density, bool) or not (isinstance(density, (int, float))
                                               and 0.0 < density <= 1.0):
            raise ValueError(f"density must be a fraction in (0, 1] or \"auto\", got {density!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1 (elements), got {chunk_size!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS} (top-k per pack or over "
                             f"the whole model), got {selection!r}")
        if isinstance(min_density, bool) or not (isinstance(min_density, (int, float))
                                                 and 0.0 < min_density <= 1.0):
            raise ValueError(f"min_density must be a fraction in (0, 1] (the floor of "
                             f"density=\"auto\"), got {min_density!r}")
        if isinstance(auto_budget, bool) or not (isinstance(auto_budget, (int, float))
                                                 and 0.0 < auto_budget < math.inf):
            raise ValueError(f"auto_budget must be a number > 0 (communication seconds per "
                             f"compute second), got {auto_budget!r}")
        self.density = AUTO if density == AUTO else float(density)
        self.chunk_size = chunk_size
        self.warmup_steps = warmup_steps
        self.momentum = float(momentum)
        self.warmup = warmup
        self.selection = selection
        self.min_density = float(min_density)
        self.auto_budget = float(auto_budget)

    @property
    def auto(self) -> bool:
        """True for density="auto"."""
        return self.density == AUTO

    def rungs(self) -> Tuple[float, ...]:
        """The densities density="auto" chooses from, largest first.

        AUTO_LADDER's entries above `min_density`, then `min_density` (the
        floor, always the last rung). For a numeric density: (density,).
        """
        if not self.auto:
            return (self.density,)
        return tuple(d for d in AUTO_LADDER if d > self.min_density) + (self.min_density,)

    def __repr__(self):
        auto = (f", min_density={self.min_density}, auto_budget={self.auto_budget}"
                if self.auto else "")
        return (f"ChunkSparsity(density={self.density!r}, chunk_size={self.chunk_size}, "
                f"warmup_steps={self.warmup_steps}, momentum={self.momentum}, "
                f"warmup={self.warmup!r}, selection={self.selection!r}{auto})")

    # -- schedule ----------------------------------------------------------

    def schedule(self) -> Tuple[Tuple[int, Union[float, str]], ...]:
        """The density schedule as ((first_step, density), ...).

        first_step ascending from 0, density non-increasing; a stage lasts
        until the next one's first_step, the last one forever; density 1.0
        is a dense step. Examples (density=0.001, warmup_steps=400):
        "dense": ((0, 1.0), (400, 0.001));
        "exponential": ((0, 0.25), (100, 0.0625), (200, 0.015625),
        (300, 0.00390625), (400, 0.001)).
        With density="auto" the last stage's density is "auto" (chosen each
        step among `rungs()`), and the exponential ramp stops above
        `min_density`.
        """
        if self.warmup_steps == 0:
            return ((0, self.density),)
        target = self.min_density if self.auto else self.density
        if self.warmup == "dense":
            ramp = [1.0] if target < 1.0 else []
        else:
            ramp = []
            d = 0.25
            while d > target:
                ramp.append(d)
                d /= 4
        stages = [(i * self.warmup_steps // len(ramp), d) for i, d in enumerate(ramp)]
        stages.append((self.warmup_steps, self.density))
        # Stages shorter than one step (warmup_steps < len(ramp)) vanish.
        return tuple(s for s, nxt in zip(stages, stages[1:] + [None])
                     if nxt is None or nxt[0] > s[0])

    def density_at(self, step: int) -> Union[float, str]:
        """Density of all-reduce step `step` (0-based) under `schedule()` ("auto" after an auto warm-up)."""
        current = self.density
        for first_step, density in self.schedule():
            if step >= first_step:
                current = density
        return current

    def reducer(self) -> "CSCReducer":
        """The reducer GradientFlowAllReduce runs each pack through."""
        return CSCReducer(self)

    def get_config(self) -> dict:
        """The constructor arguments (also compared across workers by GradientFlowAllReduce)."""
        config = {"density": self.density, "chunk_size": self.chunk_size,
                  "warmup_steps": self.warmup_steps, "momentum": self.momentum,
                  "warmup": self.warmup, "selection": self.selection}
        if self.auto:
            config.update(min_density=self.min_density, auto_budget=self.auto_budget)
        return config


class CSCState(tf.Module):
    """CSC state of one pack on this worker: plain (not mirrored) local variables.

    steps: per local replica, int64 scalar on the host: all-reduce steps run.
    residuals: per local replica, float32 [n] on the replica's device.
    velocities: per local replica, float32 [n] (momentum > 0), else None.
    residual_l1: float32 scalar: L1 norm of local replica 0's residual.
    started, done, sent (density="auto" only, else None; the first pack's serve
      the variable set): per local replica, on the host, of the last step:
      float64 seconds (clock time) when its chunk all-reduce started and when
      it ended (0: no step measured yet), float32 bytes the step sent.
      Timing only: not checkpointed (a restored run starts at the floor).
    """

    def __init__(self, name: str, num_elements: int, devices: Sequence[str], momentum: bool,
                 timing: bool = False):
        super().__init__(name=None)
        n = num_elements
        with tf.init_scope():
            self.steps = [tf_internal.local_variable(tf.constant(0, tf.int64), "/cpu:0",
                                                     f"gf_step_{name}_r{r}")
                          for r in range(len(devices))]
            self.residuals = [tf_internal.local_variable(tf.zeros([n], tf.float32), d,
                                                         f"gf_residual_{name}_r{r}")
                              for r, d in enumerate(devices)]
            self.velocities = None
            if momentum:
                self.velocities = [tf_internal.local_variable(tf.zeros([n], tf.float32), d,
                                                              f"gf_velocity_{name}_r{r}")
                                   for r, d in enumerate(devices)]
            self.residual_l1 = tf_internal.local_variable(tf.constant(0.0), "/cpu:0",
                                                          f"gf_residual_l1_{name}")
            self.started = self.done = self.sent = None
            if timing:
                self.started, self.done, self.sent = (
                    [tf_internal.local_variable(tf.constant(0.0, dtype), "/cpu:0",
                                                f"gf_{what}_{name}_r{r}")
                     for r in range(len(devices))]
                    for what, dtype in (("started", tf.float64), ("done", tf.float64),
                                        ("sent", tf.float32)))

    @property
    def step(self) -> tf.Variable:
        """Local replica 0's step counter."""
        return self.steps[0]


def _timestamp(replica: int, event: str) -> tf.Tensor:
    """CSCReducer's default clock: tf.timestamp() (float64 seconds since the epoch)."""
    del replica, event
    return tf.timestamp()


class CSCReducer(Reducer):
    """The CSC reducer of `gf_tf.reducers`: top-k chunks of residual + gradient (module doc).

    clock: density="auto"'s clock, clock(replica, event) -> float64 scalar
      seconds, event "ready" (the replica's gradients are ready), "send" (its
      chunk all-reduce can start) or "done" (it ended); tf.timestamp() by default. Tests replace it
      (before the first trace) to feed known figures.
    """

    # density="auto": figures each replica adds to the step's control all-reduce.
    TIMING_FIGURES = ("compute_seconds", "comm_seconds", "comm_bytes")

    def __init__(self, sparsity: ChunkSparsity):
        self.sparsity = sparsity
        self.clock = _timestamp

    def create_state(self, pack, devices):
        name = pack.key.replace("/", "_")
        return CSCState(name, pack.num_elements, devices, self.sparsity.momentum > 0.0,
                        timing=self.sparsity.auto)

    def control_size(self, pack):
        return ops.num_chunks(pack.num_elements, self.sparsity.chunk_size)

    def control(self, pack, grads, state, comm):
        accs, norms, new_us = [], [], []
        for g, r in zip(grads, comm.replicas):
            residual = state.residuals[r]
            u = state.velocities[r] if state.velocities else None
            with tf.device(residual.device):
                acc, norm, new_u = ops.accumulate(residual, g, self.sparsity.chunk_size, u,
                                                  self.sparsity.momentum)
            accs.append(acc)
            norms.append(norm)
            new_us.append(new_u)
        return norms, (accs, norms, new_us)

    def step_control_size(self, packs):
        return len(self.TIMING_FIGURES) if self.sparsity.auto else 0

    def step_control(self, packs, grads, states, comm):
        """density="auto": per served replica float32 [3]: this step's compute seconds, the
        previous step's communication seconds and bytes (zeros before the first measurement).

        The clock reads "ready" once all of the replica's gradients exist; the
        previous step's "send" and "done" were read when its chunk all-reduce
        started and ended, so the communication seconds leave out the local
        chunk path (accumulate, top-k, gather, scatter), which costs the same at
        every rung."""
        if not self.step_control_size(packs):
            return super().step_control(packs, grads, states, comm)
        state, vectors = states[0], []
        for i, r in enumerate(comm.replicas):
            tensors = [t for pack_grads in grads for t in pack_grads[i]]
            with tf.device("/cpu:0"):
                with tf.control_dependencies(tensors):
                    ready = tf.cast(self.clock(r, "ready"), tf.float64)
                done, started = state.done[r].read_value(), state.started[r].read_value()
                figures = tf.cast(tf.stack([ready - done, done - started,
                                            tf.cast(state.sent[r].read_value(), tf.float64)]),
                                  tf.float32)
                vectors.append(tf.where(done > 0.0, figures, tf.zeros_like(figures)))
        return vectors

    def reduce_packs(self, packs, grads, controls, carries, states, comm, step_control=None):
        """All packs of one variable set in one collective per wire dtype (one in practice).

        The packs share the schedule and step counter, so one `tf.switch_case`
        over the candidates (schedule stages; with density="auto" the warm-up
        stages and the rungs) picks every pack's k at once.
        """
        candidates = self._candidates(packs)
        branches = list(dict.fromkeys(ks for _, _, ks in candidates))

        def branch(ks):
            return lambda: self._step(packs, controls, carries, states, comm, ks)

        index = self._candidate_index(packs, candidates, states, comm, step_control)
        if len(branches) == 1:
            result = branch(branches[0])()
        else:
            with tf.device("/cpu:0"):
                which = tf.gather([branches.index(ks) for _, _, ks in candidates], index)
            result = tf.switch_case(which, [branch(ks) for ks in branches])
        outputs, sent_bytes, selected, residual_l1, started, done = result
        with tf.device("/cpu:0"):
            density = tf.gather(tf.constant([d for _, d, _ in candidates], tf.float64), index)
            for state in states:
                for r in comm.replicas:
                    state.steps[r].assign_add(1)
            for r, t0, t1 in zip(comm.replicas, started, done):
                states[0].started[r].assign(t0)
                states[0].done[r].assign(t1)
                states[0].sent[r].assign(tf.cast(sent_bytes, tf.float32))
        sent = Sent(dense_bytes=4 * sum(p.num_elements for p in packs), sent_bytes=sent_bytes,
                    selected_chunks=selected,
                    total_chunks=sum(self.control_size(p) for p in packs),
                    residual_norm=residual_l1, density=density)
        per_pack, i, num_replicas = [], 0, len(comm.replicas)
        for pack in packs:
            size = len(pack.shapes) * num_replicas
            per_pack.append(_split(outputs[i:i + size], [len(pack.shapes)] * num_replicas))
            i += size
        return per_pack, sent

    def _candidates(self, packs):
        """((first_step or None, density, ks), ...): the schedule's stages, then (density="auto")
        one per rung with first_step None. ks: per pack its k, or None (every chunk)."""
        stages = [(s, d) for s, d in self.sparsity.schedule() if d != AUTO]
        stages += [(None, d) for d in self.sparsity.rungs()] if self.sparsity.auto else []
        return tuple((first_step, density, self._ks(packs, density))
                     for first_step, density in stages)

    def _candidate_index(self, packs, candidates, states, comm, step_control):
        """int32 index into `candidates` for this step (a Python 0 when there is one)."""
        if len(candidates) == 1:
            return 0
        staged = [s for s, _, _ in candidates if s is not None]
        with tf.device("/cpu:0"):
            step = states[0].steps[comm.replicas[0]].read_value()
            stage = tf.reduce_sum(tf.cast(step >= tf.constant(staged, tf.int64), tf.int32)) - 1
            if not self.sparsity.auto:
                return stage
            mean = step_control[0] / comm.num_replicas    # the same sums on every replica
            rung = choose_rung(mean[0], mean[1], mean[2],
                               [self._sent_bytes(packs, ks) for s, _, ks in candidates
                                if s is None], self.sparsity.auto_budget)
            return tf.where(step >= self.sparsity.warmup_steps, len(staged) + rung, stage)

    def _sent_bytes(self, packs, ks) -> int:
        """Bytes one replica puts into the step's collectives when the packs send ks."""
        total = 4 * self.step_control_size(packs)
        for members in _wire_groups(packs):
            total += (4 * sum(self.control_size(packs[j]) for j in members)
                      + self._wire_length(packs, members, ks) * packs[members[0]].wire_dtype.size)
        return total

    def _wire_length(self, packs, members, ks) -> int:
        """Elements of one wire group's chunk buffer: K chunks (global), else each pack's k or all."""
        if self.sparsity.selection == "global" and ks[members[0]] is not None:
            return ks[members[0]] * self.sparsity.chunk_size
        return sum(packs[j].num_elements if ks[j] is None else ks[j] * self.sparsity.chunk_size
                   for j in members)

    def _selected_chunks(self, packs, ks) -> int:
        """Chunks one step sends (a dense pack counts all of its chunks)."""
        total = 0
        for members in _wire_groups(packs):
            if self.sparsity.selection == "global" and ks[members[0]] is not None:
                total += ks[members[0]]
            else:
                total += sum(self.control_size(packs[j]) if ks[j] is None else ks[j] for j in members)
        return total

    def _ks(self, packs, density):
        """Per pack its k, or None (every chunk: a dense step), at `density`.

        selection="global": the K of the pack's wire group (one top K over the
        chunks of all its packs), None for every pack of a group K covers whole.
        """
        counts = [self.control_size(pack) for pack in packs]
        if self.sparsity.selection == "global":
            for members in _wire_groups(packs):
                total = sum(counts[j] for j in members)
                for j in members:
                    counts[j] = total
        ks = [selected_chunk_count(c, density) for c in counts]
        return tuple(None if k >= c else k for k, c in zip(ks, counts))

    def _step(self, packs, controls, carries, states, comm, ks):
        """One step: every pack sends its k chunks (None: all, a dense warm-up step).

        selection="global": ks holds each pack's wire group's K; the group's
        packs send their shares of one top K (`_global_picks`).
        """
        groups = _wire_groups(packs)
        picks = [None] * len(packs)
        if self.sparsity.selection == "global":
            for members in groups:
                if ks[members[0]] is not None:
                    shares = self._global_picks([packs[j] for j in members],
                                                [controls[j] for j in members],
                                                states[members[0]], comm, ks[members[0]])
                    for j, share in zip(members, shares):
                        picks[j] = share
        sends = [self._gather(p, c, a, s, comm, k, pk)
                 for p, c, a, s, k, pk in zip(packs, controls, carries, states, ks, picks)]
        received = [[None] * len(comm.replicas) for _ in packs]
        reduced, started = [[] for _ in comm.replicas], []
        for members in groups:
            length = self._wire_length(packs, members, ks)
            buffers = [_pad_to(tf.concat([sends[j]["buffers"][r] for j in members], 0), length)
                       for r in range(len(comm.replicas))]
            if self.sparsity.auto and not started:   # the start of this step's chunk all-reduce
                buffers, started = self._clocked(buffers, comm)
            fused = comm.all_reduce_sum(buffers)
            for r, buffer in enumerate(fused):
                reduced[r].append(buffer)
                with tf.device(buffer.device):
                    sizes = [sends[j]["sizes"][r] for j in members]
                    for j, part in zip(members, tf.split(buffer, sizes + [-1])):
                        received[j][r] = part
        done = []
        if self.sparsity.auto:      # the end of this step's communication, per replica
            for r, buffers in zip(comm.replicas, reduced):
                with tf.device("/cpu:0"), tf.control_dependencies(buffers):
                    done.append(tf.cast(self.clock(r, "done"), tf.float64))
        outputs, residual_l1 = [], 0.0
        for pack, send, parts, k in zip(packs, sends, received, ks):
            outputs.extend(self._scatter(pack, send, parts, k))
            residual_l1 += send["residual_l1"]
        return (_flatten_replicas(outputs, len(comm.replicas)),
                tf.constant(self._sent_bytes(packs, ks), tf.int64),
                tf.constant(self._selected_chunks(packs, ks), tf.int64), residual_l1, started, done)

    def _clocked(self, buffers, comm):
        """(buffers, per replica the "send" clock): the buffers wait for the clock, which waits
        for them, so the clock reads when the collective can start."""
        clocked, started = [], []
        for r, buffer in zip(comm.replicas, buffers):
            with tf.device("/cpu:0"), tf.control_dependencies([buffer]):
                started.append(tf.cast(self.clock(r, "send"), tf.float64))
            with tf.device(buffer.device), tf.control_dependencies([started[-1]]):
                clocked.append(tf.identity(buffer))
        return clocked, started

    def _global_picks(self, packs, controls, state, comm, k):
        """selection="global": per pack, per served replica, its share of one top k.

        The all-reduced norms of `packs` (one wire group) are concatenated in
        pack order; `select_chunks` takes the k largest (ties: the lower index
        in that order; NaN first). Pack p's share: the selected indices in
        [offset_p, offset_p + C_p), minus offset_p: int32 [k_p], ascending,
        k_p a run-time number with sum over packs = k, equal on every replica.
        """
        offsets = [0]
        for pack in packs:
            offsets.append(offsets[-1] + self.control_size(pack))
        shares = [[] for _ in packs]
        for i, r in enumerate(comm.replicas):
            with tf.device(state.residuals[r].device):
                idx = select_chunks(tf.concat([control[i] for control in controls], 0), k)
                bounds = tf.searchsorted(idx, tf.constant(offsets, idx.dtype), side="left")
                for share, part, offset in zip(shares, tf.split(idx, bounds[1:] - bounds[:-1]),
                                               offsets):
                    share.append(part - offset)
        return shares

    def _gather(self, pack, control, carry, state, comm, k, picks=None):
        """The pack's chunks to send, per served replica: idx from `picks` (per replica,
        selection="global": unpadded, "sizes" their run-time lengths) or its own top k
        (padded to the static "length" k*chunk_size)."""
        n, cs, wire = pack.num_elements, self.sparsity.chunk_size, pack.wire_dtype
        c = self.control_size(pack)
        length = n if k is None else k * cs
        accs, local_norms, new_us = carry
        send = {"length": length, "sizes": [], "buffers": [], "picks": [], "finites": [],
                "postscales": [], "updates": []}
        for i, (acc, norms, new_u, r) in enumerate(zip(accs, control, new_us, comm.replicas)):
            residual = state.residuals[r]
            u = state.velocities[r] if state.velocities else None
            with tf.device(residual.device):
                finite = tf.reduce_all(tf.math.is_finite(norms))
                if picks is not None:
                    idx = picks[i]
                elif k is None:
                    idx = tf.range(c, dtype=tf.int32)
                else:
                    idx = select_chunks(norms, k)
                prescale, postscale = _chunk_scales(norms, idx, wire, comm)
                selected, new_residual, masked_u = ops.gather_chunks(
                    acc, idx, cs, wire, prescale, new_u if k is not None else None)
                if picks is None:
                    # Static wire shape on every step: pad a selected partial last chunk.
                    selected = _pad_to(selected, length)
            send["sizes"].append(length if picks is None else tf.size(selected))
            send["buffers"].append(selected)
            send["picks"].append(idx)
            send["finites"].append(finite)
            send["postscales"].append(postscale)
            pairs = [(residual, new_residual)]
            if u is not None:
                pairs.append((u, new_u if k is None else masked_u))
            send["updates"].append(pairs)
        with tf.device("/cpu:0"):
            sent_chunks = tf.reshape(send["picks"][0], [-1, 1])
            new_l1 = tf.reduce_sum(tf.tensor_scatter_nd_update(
                local_norms[0], sent_chunks, tf.zeros(tf.shape(send["picks"][0]), tf.float32)))
            send["residual_l1"] = tf.where(send["finites"][0], new_l1,
                                           state.residual_l1.read_value())
            if comm.replicas[0] == 0:
                state.residual_l1.assign(send["residual_l1"])
        return send

    def _scatter(self, pack, send, parts, k):
        """Per served replica, the pack's tensors from its received chunks; commits the state."""
        n, cs = pack.num_elements, self.sparsity.chunk_size
        outputs = []
        for buf, idx, finite, postscale, pairs in zip(parts, send["picks"], send["finites"],
                                                       send["postscales"], send["updates"]):
            with tf.device(pairs[0][0].device):
                m = n if k is None else _selected_length(n, cs, idx)
                outputs.append(ops.scatter_chunks(buf[:m], idx, cs, pack.shapes, pack.dtypes,
                                                  postscale))
                _assign_if(finite, pairs)
        return [outputs]


def _selected_length(n, chunk_size, idx):
    """Elements in the (sorted) chunks idx of a pack of n elements: the last chunk may be partial."""
    c = ops.num_chunks(n, chunk_size)
    short = c * chunk_size - n
    has_last = tf.reduce_any(tf.equal(idx, c - 1))     # idx may be empty (selection="global")
    return tf.size(idx) * chunk_size - short * tf.cast(has_last, tf.int32)


def _wire_groups(packs):
    """Indices of `packs` grouped by wire dtype (one chunk all-reduce each), in pack order."""
    groups = {}
    for j, pack in enumerate(packs):
        groups.setdefault(pack.wire_dtype, []).append(j)
    return list(groups.values())


def _pad_to(buffer, length):
    """1-D `buffer` zero-padded at the end to the static `length` (>= its length)."""
    if buffer.shape[0] == length:
        return buffer
    return tf.ensure_shape(tf.pad(buffer, [[0, length - tf.shape(buffer)[0]]]), [length])


def _chunk_scales(norms, idx, wire_dtype, comm):
    """(prescale, postscale) per selected chunk: powers of two from the all-reduced L1 norms."""
    mean = 1.0 / comm.num_replicas if comm.mean else 1.0
    if not compression_lib.needs_scaling(wire_dtype):
        return 1.0, mean
    prescale = compression_lib.power_of_two_scale(tf.gather(norms, idx))
    return prescale, mean / prescale


def _assign_if(condition, pairs):
    """variable.assign(value) for each pair when `condition` (scalar bool) holds."""
    def assign():
        for variable, value in pairs:
            variable.assign(value)
        return tf.constant(True)
    tf.cond(condition, assign, lambda: tf.constant(False))


def _flatten_replicas(per_pack, num_replicas):
    """[[replica 0 tensors, replica 1 tensors, ...] per pack] -> one flat list, pack by pack."""
    return [t for outputs in per_pack for r in range(num_replicas) for t in outputs[r]]


def _split(flat, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(list(flat[i:i + s]))
        i += s
    return out
