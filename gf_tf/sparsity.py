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
  sel = chunks idx of acc, prescaled (x 1/N on a 16-bit wire) and cast to
        the wire dtype, zero-padded to k*chunk_size (a static shape)
  sel = all-reduce(sel)                    SUM over all N replicas
  out = sel postscaled (x N) and scattered back into the pack's tensors,
        0 elsewhere
  residual = acc with chunks idx set to 0  (assignment: error feedback)
  u   = u with chunks idx set to 0         (momentum factor masking)

A step whose all-reduced norms are not finite leaves residual and u as they
were (its output carries the inf/NaN so a loss-scale optimizer skips it).
"""

import dataclasses
import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf import compression as compression_lib
from gf_tf import ops, tf_internal

# Chosen with benchmarks/csc_defaults.py and benchmarks/convergence.py: at
# 1024 elements the norms cost 0.1% of the float32 bytes (15% of what a 1%
# step sends; 43% at 256), the 0.54M-parameter digits CNN still has 533 chunks,
# the selected chunks carry about as much of the accumulator's L1 mass per
# step as 16-256 element chunks (2.2% vs 2.3-2.8% at density 1%), and density
# 1% (151x fewer bytes) trains the digits CNN as well as dense float32.
DEFAULT_CHUNK_SIZE = 1024
DEFAULT_DENSITY = 0.01

WARMUP_MODES = ("dense", "exponential")

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


@dataclasses.dataclass
class _PackState:
    """CSC state of one pack: plain (not mirrored) local variables."""
    step: tf.Variable                      # int64 scalar, host CPU
    residuals: List[tf.Variable]           # float32 [n] per local replica
    velocities: Optional[List[tf.Variable]]  # float32 [n] per local replica, or None
    residual_l1: tf.Variable               # float32 scalar: L1 of replica 0's residual


class ChunkSparsity:
    """CSC configuration and state, for `GradientFlowAllReduce(sparsity=...)`.

    Args:
      density: target fraction of chunks sent per step, in (0, 1]. k =
        max(1, ceil(density * num_chunks)) chunks of each pack are sent.
        1.0 means dense.
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

    Raises:
      ValueError naming the argument when one is out of range.

    State: per pack (keyed by `PackSpec.key`) and local replica, a residual
    (and with momentum a velocity) float32 tf.Variable of the pack's size on
    the replica's device, plus a step counter on the host; created at the
    first trace, outside any strategy scope (plain local variables). A new
    pack plan (e.g. a layer frozen between `fit` calls) after steps have run
    drops all state with a warning; the new packs start from zero residuals
    and a fresh warm-up. State is NOT saved in checkpoints: after a restart
    (e.g. `keras.callbacks.BackupAndRestore`) residuals start from zero and
    the warm-up runs again; within one process `reset()` does the same.
    One ChunkSparsity belongs to one GradientFlowAllReduce.
    """

    def __init__(self, density: float = DEFAULT_DENSITY,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, warmup_steps: int = 0,
                 momentum: float = 0.0, warmup: str = "dense"):
        if not (isinstance(density, (int, float)) and 0.0 < density <= 1.0):
            raise ValueError(f"density must be a fraction in (0, 1], got {density!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1 (elements), got {chunk_size!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
        self.density = float(density)
        self.chunk_size = chunk_size
        self.warmup_steps = warmup_steps
        self.momentum = float(momentum)
        self.warmup = warmup
        self._state: Dict[str, _PackState] = {}

    def __repr__(self):
        return (f"ChunkSparsity(density={self.density}, chunk_size={self.chunk_size}, "
                f"warmup_steps={self.warmup_steps}, momentum={self.momentum}, "
                f"warmup={self.warmup!r})")

    # -- schedule ----------------------------------------------------------

    def schedule(self) -> Tuple[Tuple[int, float], ...]:
        """The density schedule as ((first_step, density), ...).

        first_step ascending from 0, density non-increasing; a stage lasts
        until the next one's first_step, the last one forever; density 1.0
        is a dense step. Examples (density=0.001, warmup_steps=400):
        "dense": ((0, 1.0), (400, 0.001));
        "exponential": ((0, 0.25), (100, 0.0625), (200, 0.015625),
        (300, 0.00390625), (400, 0.001)).
        """
        if self.warmup_steps == 0:
            return ((0, self.density),)
        if self.warmup == "dense":
            ramp = [1.0] if self.density < 1.0 else []
        else:
            ramp = []
            d = 0.25
            while d > self.density:
                ramp.append(d)
                d /= 4
        stages = [(i * self.warmup_steps // len(ramp), d) for i, d in enumerate(ramp)]
        stages.append((self.warmup_steps, self.density))
        # Stages shorter than one step (warmup_steps < len(ramp)) vanish.
        return tuple(s for s, nxt in zip(stages, stages[1:] + [None])
                     if nxt is None or nxt[0] > s[0])

    def density_at(self, step: int) -> float:
        """Density of all-reduce step `step` (0-based) under `schedule()`."""
        current = self.density
        for first_step, density in self.schedule():
            if step >= first_step:
                current = density
        return current

    def _pack_stages(self, num_chunks: int) -> Tuple[Tuple[int, Optional[int]], ...]:
        """Per pack: ((first_step, k or None for dense), ...), equal neighbours merged.

        A stage that would send every chunk is a dense step (no norms, no
        momentum masking: plain momentum SGD while everything is sent).
        """
        stages = []
        for first_step, density in self.schedule():
            k = selected_chunk_count(num_chunks, density)
            k = None if k >= num_chunks else k
            if not stages or stages[-1][1] != k:
                stages.append((first_step, k))
        return tuple(stages)

    # -- state -------------------------------------------------------------

    def reset(self):
        """Drops all residuals, velocities and step counters (eagerly)."""
        self._state = {}

    def states(self) -> Dict[str, _PackState]:
        """The state per pack key (step, residuals, velocities, residual_l1); read-only use."""
        return dict(self._state)

    def get_config(self) -> dict:
        """The constructor arguments (also compared across workers by GradientFlowAllReduce)."""
        return {"density": self.density, "chunk_size": self.chunk_size,
                "warmup_steps": self.warmup_steps, "momentum": self.momentum,
                "warmup": self.warmup}

    def _get_state(self, pack, devices: Sequence[str]) -> _PackState:
        state = self._state.get(pack.key)
        if state is not None:
            return state
        with tf.init_scope():
            if any(int(s.step.numpy()) > 0 for s in self._state.values()):
                _log.warning(
                    "gf_tf CSC: the pack plan changed (new pack %s; the variable list "
                    "differs from the one trained so far); residuals and momentum are "
                    "reset to zero and the warm-up starts again.", pack.key)
                self._state = {}
            n = pack.num_elements
            name = pack.key.replace("/", "_")
            residuals = [tf_internal.local_variable(tf.zeros([n], tf.float32), d, f"gf_residual_{name}_r{r}")
                         for r, d in enumerate(devices)]
            velocities = None
            if self.momentum > 0.0:
                velocities = [tf_internal.local_variable(tf.zeros([n], tf.float32), d,
                                              f"gf_velocity_{name}_r{r}")
                              for r, d in enumerate(devices)]
            state = _PackState(
                step=tf_internal.local_variable(tf.constant(0, tf.int64), "/cpu:0", f"gf_step_{name}"),
                residuals=residuals, velocities=velocities,
                residual_l1=tf_internal.local_variable(tf.constant(0.0), "/cpu:0", f"gf_residual_l1_{name}"))
        self._state[pack.key] = state
        return state

    # -- the all-reduce ----------------------------------------------------

    def reduce_pack(self, pack, per_replica_grads: Sequence[Sequence[tf.Tensor]],
                    all_reduce_sum, num_replicas: int, wire_dtype: tf.DType,
                    stats=None) -> List[List[tf.Tensor]]:
        """CSC all-reduce (SUM) of one pack on every local replica.

        Args:
          pack: a `gf_tf.packing.PackSpec` (key, shapes, dtypes, num_elements).
          per_replica_grads: per local replica, the pack's gradient tensors in
            pack order, each on its replica's device (floating dtypes).
          all_reduce_sum: one 1-D tensor per local replica -> per local
            replica the SUM over all replicas of all workers (float16,
            bfloat16 or float32).
          num_replicas: N, replicas over all workers.
          wire_dtype: dtype of the selected values on the wire.
          stats: optional per-step accumulator with the arguments of
            `CommStats.update` as `add(...)`; receives this pack's
            dense-equivalent bytes (4 x n), sent bytes (norms 4 x C plus
            wire bytes of k x chunk_size elements, or the dense wire bytes),
            selected and total chunks, and the L1 norm of replica 0's
            residual (L1 norms of several packs add up).

        Returns:
          Per local replica, tensors of the pack's shapes and dtypes: the SUM
          over replicas of the selected chunks, 0 outside them (dense steps:
          the SUM of everything). Must be called on every worker with the
          same pack plan: the collectives depend only on the step counter.
        """
        if pack.num_elements == 0:
            return compression_lib.dense_all_reduce(pack, per_replica_grads, all_reduce_sum,
                                                    num_replicas, wire_dtype, stats=stats)
        devices = [grads[0].device for grads in per_replica_grads]
        state = self._get_state(pack, devices)
        c = ops.num_chunks(pack.num_elements, self.chunk_size)
        stages = self._pack_stages(c)

        def branch(k):
            if k is None:
                return lambda: self._dense_step(pack, state, per_replica_grads, all_reduce_sum,
                                                num_replicas, wire_dtype)
            return lambda: self._sparse_step(pack, state, per_replica_grads, all_reduce_sum,
                                             num_replicas, wire_dtype, k)

        with tf.device("/cpu:0"):
            step = state.step.read_value()
        if len(stages) == 1:
            result = branch(stages[0][1])()
        else:
            with tf.device("/cpu:0"):
                first_steps = tf.constant([s for s, _ in stages], tf.int64)
                stage = tf.reduce_sum(tf.cast(step >= first_steps, tf.int32)) - 1
            result = tf.switch_case(stage, [branch(k) for _, k in stages])
        outputs, sent_bytes, selected, residual_l1 = result
        with tf.device("/cpu:0"):
            state.step.assign_add(1)
        if stats is not None:
            stats.add(dense_bytes=4 * pack.num_elements, sent_bytes=sent_bytes,
                      selected_chunks=selected, total_chunks=c, residual_norm=residual_l1)
        sizes = [len(pack.shapes)] * len(per_replica_grads)
        return _split(outputs, sizes)

    def _dense_step(self, pack, state, per_replica_grads, all_reduce_sum, num_replicas,
                    wire_dtype):
        """Dense all-reduce of g (or of u = m*u + g). The residual is zero here:
        dense stages only precede sparse ones (k is non-increasing in step)."""
        c = ops.num_chunks(pack.num_elements, self.chunk_size)
        if state.velocities is None:
            outputs = compression_lib.dense_all_reduce(pack, per_replica_grads, all_reduce_sum,
                                                       num_replicas, wire_dtype)
        else:
            new_velocities = []
            for grads, u in zip(per_replica_grads, state.velocities):
                with tf.device(u.device):
                    new_velocities.append(self.momentum * u + ops.pack(grads, tf.float32))
            outputs = compression_lib.dense_all_reduce(
                pack, [[v] for v in new_velocities], all_reduce_sum, num_replicas, wire_dtype)
            for out, u, new_u in zip(outputs, state.velocities, new_velocities):
                with tf.device(u.device):
                    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in out])
                    _assign_if(finite, [(u, new_u)])
        sent = tf.constant(pack.num_elements * wire_dtype.size, tf.int64)
        return (_flatten(outputs), sent, tf.constant(c, tf.int64),
                tf.constant(0.0, tf.float32))

    def _sparse_step(self, pack, state, per_replica_grads, all_reduce_sum, num_replicas,
                     wire_dtype, k):
        n, cs = pack.num_elements, self.chunk_size
        c = ops.num_chunks(n, cs)
        tail = n - (c - 1) * cs            # elements of the last (maybe partial) chunk
        prescale, postscale = compression_lib.scales(wire_dtype, num_replicas)
        velocities = state.velocities or [None] * len(per_replica_grads)

        accs, local_norms, new_us = [], [], []
        for grads, residual, u in zip(per_replica_grads, state.residuals, velocities):
            with tf.device(residual.device):
                acc, norms, new_u = ops.accumulate(residual, grads, cs, u, self.momentum)
            accs.append(acc)
            local_norms.append(norms)
            new_us.append(new_u)
        global_norms = all_reduce_sum(local_norms)

        wire, picks, finites, updates = [], [], [], []
        for acc, norms, new_u, residual, u in zip(accs, global_norms, new_us,
                                                  state.residuals, velocities):
            with tf.device(residual.device):
                finite = tf.reduce_all(tf.math.is_finite(norms))
                idx = select_chunks(norms, k)
                selected, new_residual, masked_u = ops.gather_chunks(
                    acc, idx, cs, wire_dtype, prescale, new_u)
                # Static wire shape [k * cs] on every step: pad a selected partial last chunk.
                selected = tf.ensure_shape(
                    tf.pad(selected, [[0, k * cs - tf.shape(selected)[0]]]), [k * cs])
                wire.append(selected)
                picks.append(idx)
                finites.append(finite)
                pairs = [(residual, new_residual)]
                if u is not None:
                    pairs.append((u, masked_u))
                updates.append(pairs)
        summed = all_reduce_sum(wire)

        outputs = []
        for buf, idx, finite, pairs in zip(summed, picks, finites, updates):
            with tf.device(pairs[0][0].device):
                m = k * cs
                if tail < cs:
                    m -= (cs - tail) * tf.cast(tf.equal(idx[-1], c - 1), tf.int32)
                outputs.append(ops.scatter_chunks(buf[:m], idx, cs, pack.shapes, pack.dtypes,
                                                  postscale))
                _assign_if(finite, pairs)

        with tf.device("/cpu:0"):
            local0 = local_norms[0]
            new_l1 = tf.reduce_sum(local0) - tf.reduce_sum(tf.gather(local0, picks[0]))
            residual_l1 = tf.where(finites[0], new_l1, state.residual_l1.read_value())
            state.residual_l1.assign(residual_l1)
        sent = tf.constant(4 * c + k * cs * wire_dtype.size, tf.int64)
        return _flatten(outputs), sent, tf.constant(k, tf.int64), residual_l1


def _assign_if(condition, pairs):
    """variable.assign(value) for each pair when `condition` (scalar bool) holds."""
    def assign():
        for variable, value in pairs:
            variable.assign(value)
        return tf.constant(True)
    tf.cond(condition, assign, lambda: tf.constant(False))


def _flatten(nested):
    return [t for inner in nested for t in inner]


def _split(flat, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(list(flat[i:i + s]))
        i += s
    return out
