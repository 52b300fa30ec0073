"""GradientFlowAllReduce: packed FP16 (and CSC) gradient all-reduce as a tf.distribute.CrossDeviceOps.

Orchestration only: the plan comes from `packing`, the tensor work from
`gf_tf.ops` (via `compression` and `sparsity`), the collectives from the wrapped
TensorFlow cross-device ops.
"""

import weakref
import zlib
from typing import List, Optional

import numpy as np
import tensorflow as tf

from gf_tf import keras_compat, packing
from gf_tf import tf_internal
from gf_tf.compression import PACKABLE_DTYPES, as_compression, dense_all_reduce
from gf_tf.stats import CommStats

DEFAULT_BYTES_PER_PACK = 4 * 1024 * 1024

_SUM = tf.distribute.ReduceOp.SUM
_MEAN = tf.distribute.ReduceOp.MEAN


class GradientFlowAllReduce(tf.distribute.CrossDeviceOps):
    """Lazy, mixed-precision (and optionally sparse) gradient all-reduce.

    Source: GradientFlow (arXiv 1902.06855): lazy all-reduce, mixed-precision
    communication, coarse-grained sparse communication. Mirrors the contract
    of `tf.distribute.NcclAllReduce`: pass an instance as
    `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or use
    `gf_tf.MultiWorkerMirroredStrategy`.

    On every batch all-reduce (`strategy.extended.batch_reduce_to`, i.e.
    `ReplicaContext.all_reduce`, which Keras uses for gradients):
    - dense float16/bfloat16/float32 tensors with static shapes are packed per
      dtype into 1-D buffers of at most `bytes_per_pack` wire bytes, in backprop
      order (reverse of the caller's order); float32 travels as
      `compression`'s dtype; each replica's buffer is prescaled by 1/N before
      the cast and the sum postscaled by N after it (N = replicas over all
      workers), so the result is the SUM (MEAN: no postscale) and a mean beyond
      the float16 range comes back +-inf, never clamped;
    - everything else (IndexedSlices, integers, float64, unknown shapes) goes to
      the wrapped ops untouched (one batch per dtype, in the caller's order);
      None stays None.
    Each pack is one call of the wrapped ops' `batch_reduce`, so collective
    instance keys, CommunicationOptions (timeout_seconds, implementation) and
    RING/NCCL stay TensorFlow's. Single-value `reduce` (strategy.reduce:
    losses, metrics), `broadcast` and `gather` are forwarded exactly.

    Across workers the settings and the gradient list must agree: before the
    first packed all-reduce of each traced step a fixed-shape float64
    all-reduce compares them and raises ValueError naming the setting and the
    workers (merge-call path, which is every CPU run; the replica-context path
    used for XLA on all-GPU workers has no such check).

    Args:
      compression: "fp16" (default), "bf16" or None (packing only).
      bytes_per_pack: lazy all-reduce threshold in wire bytes (>= 0); 0 = one
        pack per dtype. A tensor larger than it gets a pack of its own.
      sparsity: optional `gf_tf.ChunkSparsity` (CSC); applied to every pack of
        a SUM all-reduce.
      cross_device_ops: the TensorFlow cross-device ops that carry the packs;
        None = the one the strategy would use by itself (MirroredStrategy's
        CollectiveAllReduce; set by gf_tf.MultiWorkerMirroredStrategy).

    Attributes:
      stats: `gf_tf.stats.CommStats`, updated once per batch all-reduce. Its
        variables are created on first use, not in the constructor: creating
        variables initialises the TF runtime, which must not happen before a
        MultiWorkerMirroredStrategy configures its collectives.

    Raises:
      ValueError: bad compression / bytes_per_pack; settings differing across
        workers; MEAN with sparsity.
    """

    def __init__(self, compression: Optional[str] = "fp16",
                 bytes_per_pack: int = DEFAULT_BYTES_PER_PACK, sparsity=None,
                 cross_device_ops: Optional[tf.distribute.CrossDeviceOps] = None):
        super().__init__()
        self.compression = as_compression(compression)
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, (int, np.integer)) \
                or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be an integer number of bytes >= 0, "
                             f"got {bytes_per_pack!r}")
        if isinstance(cross_device_ops, GradientFlowAllReduce):
            raise ValueError("cross_device_ops must be a TensorFlow cross-device ops, "
                             "not another GradientFlowAllReduce")
        self.bytes_per_pack = int(bytes_per_pack)
        self.sparsity = sparsity
        self._wrapped = cross_device_ops
        self._workers = None  # gf_tf.strategy.WorkerInfo, set by gf_tf.MultiWorkerMirroredStrategy
        self._stats = None
        self._strategy = None  # weakref to the strategy whose default ops we took
        keras_compat.install()  # Keras's multi-step/accumulation fixes for MirroredStrategy users

    def __repr__(self):
        return (f"GradientFlowAllReduce(compression={self.compression.name!r}, "
                f"bytes_per_pack={self.bytes_per_pack}, sparsity={self.sparsity!r})")

    @property
    def stats(self) -> CommStats:
        if self._stats is None:
            with tf.init_scope():
                self._stats = CommStats()
        return self._stats

    # --- wiring -------------------------------------------------------------

    def _attach(self, wrapped, workers):
        """Called by gf_tf.MultiWorkerMirroredStrategy: wrap its CollectiveAllReduce."""
        if self._wrapped is not None or self._workers is not None:
            raise ValueError("gf_tf.MultiWorkerMirroredStrategy needs a GradientFlowAllReduce of "
                             "its own, built with cross_device_ops=None (it wraps the strategy's "
                             "CollectiveAllReduce); this one already has cross-device ops")
        self._wrapped, self._workers = wrapped, workers
        self.stats  # pylint: disable=pointless-statement  # now, outside any scope and trace

    def _cross_ops(self) -> tf.distribute.CrossDeviceOps:
        if self._wrapped is None:
            strategy = tf.distribute.get_strategy()
            self._wrapped = tf_internal.default_cross_device_ops(strategy)
            self._strategy = weakref.ref(strategy)
        elif self._strategy is not None and self._strategy() is not tf.distribute.get_strategy():
            raise ValueError("this GradientFlowAllReduce already carries the collectives of another "
                             "strategy; create one GradientFlowAllReduce per strategy")
        return self._wrapped

    @property
    def _num_between_graph_workers(self):
        return tf_internal.num_workers_of(self._wrapped) if self._wrapped is not None else 1

    # --- merge-call path ----------------------------------------------------

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """As `tf.distribute.CrossDeviceOps.batch_reduce`; a None value comes back as None."""
        pairs = list(value_destination_pairs)
        kept = [i for i, (value, _) in enumerate(pairs) if value is not None]
        if len(kept) == len(pairs):
            return super().batch_reduce(reduce_op, pairs, options)
        results = [None] * len(pairs)
        if kept:
            reduced = super().batch_reduce(reduce_op, [pairs[i] for i in kept], options)
            for i, r in zip(kept, reduced):
                results[i] = r
        return results

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        wrapped = self._cross_ops()
        pairs = list(value_destination_pairs)
        if not tf_internal.destinations_match(pairs):
            return wrapped.batch_reduce_implementation(reduce_op, pairs, options)

        per_replica = [tf_internal.local_values(value) for value, _ in pairs]
        num_local = len(per_replica[0])
        num_replicas = num_local * tf_internal.num_workers_of(wrapped)
        signature = [_packable_signature(values) for values in per_replica]
        plan = packing.plan_packs(signature, self.bytes_per_pack, self.compression.wire_dtype)
        self._check_workers_agree(signature, per_replica[0], options)

        def all_reduce_sum(tensors: List[tf.Tensor]) -> List[tf.Tensor]:
            pr = tf_internal.per_replica(tensors)
            return tf_internal.local_values(wrapped.batch_reduce(_SUM, [(pr, pr)], options)[0])

        totals = _StepTotals()
        results = [None] * len(pairs)
        for pack in plan:
            grads = [[per_replica[i][r] for i in pack.indices] for r in range(num_local)]
            reduced = self._reduce_pack(pack, grads, all_reduce_sum, num_replicas,
                                        reduce_op, totals)
            for j, i in enumerate(pack.indices):
                results[i] = tf_internal.mirrored([reduced[r][j] for r in range(num_local)])

        others = [i for i, entry in enumerate(signature) if entry is None]
        for group in _groups_by_dtype(others, [per_replica[i][0] for i in others]):
            reduced = wrapped.batch_reduce(reduce_op, [pairs[i] for i in group], options)
            for i, r in zip(group, reduced):
                results[i] = r
        if plan:
            self.stats.update(**totals.as_kwargs())
        return results

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        # Single values are losses/metrics (strategy.reduce): kept exact.
        return self._cross_ops().reduce_implementation(reduce_op, per_replica_value,
                                                       destinations, options)

    def broadcast_implementation(self, tensor, destinations):
        return self._cross_ops().broadcast_implementation(tensor, destinations)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return tf_internal.gather(self._cross_ops(), per_replica_value, destinations, axis,
                                  options)

    # --- replica-context path (no merge_call: XLA on all-GPU devices) --------

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """As `CrossDeviceOps._all_reduce`: one replica's nest of values, reduced."""
        wrapped = self._cross_ops()
        flat = tf.nest.flatten(value)
        signature = [None if t is None else _packable_signature([t]) for t in flat]
        plan = packing.plan_packs(signature, self.bytes_per_pack, self.compression.wire_dtype)
        if plan and self.sparsity is not None:
            raise NotImplementedError(
                "sparsity is not supported on the replica-context all-reduce path (XLA on "
                "all-GPU devices); run the step without jit_compile")
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync

        def all_reduce_sum(tensors):
            return [tf_internal.replica_all_reduce(wrapped, _SUM, tensors[0], replica_id, options)]

        results = list(flat)
        for pack in plan:
            reduced = dense_all_reduce(pack, [[flat[i] for i in pack.indices]], all_reduce_sum,
                                       num_replicas, pack.wire_dtype, mean=reduce_op == _MEAN)
            for j, i in enumerate(pack.indices):
                results[i] = reduced[0][j]
        others = [i for i, t in enumerate(flat) if t is not None and signature[i] is None]
        for group in _groups_by_dtype(others, [flat[i] for i in others]):
            reduced = tf_internal.replica_all_reduce(wrapped, reduce_op, [flat[i] for i in group],
                                                     replica_id, options)
            for i, r in zip(group, reduced):
                results[i] = r
        return tf.nest.pack_sequence_as(value, results)

    # --- helpers --------------------------------------------------------------

    def _reduce_pack(self, pack, grads, all_reduce_sum, num_replicas, reduce_op, totals):
        if self.sparsity is None:
            return dense_all_reduce(pack, grads, all_reduce_sum, num_replicas, pack.wire_dtype,
                                    mean=reduce_op == _MEAN, stats=totals)
        if reduce_op != _SUM:
            raise ValueError(f"sparsity (CSC) supports SUM all-reduces, as Keras issues for "
                             f"gradients; got {reduce_op}. Use sparsity=None for MEAN.")
        return self.sparsity.reduce_pack(pack, grads, all_reduce_sum, num_replicas,
                                         pack.wire_dtype, totals)

    def _settings(self, signature):
        """The fields every worker must agree on, as (name, number, how to print it)."""
        shapes = repr([None if s is None else (tuple(s[0].as_list()), s[1].name)
                       for s in signature]).encode()
        return [
            ("compression", self.compression.code,
             lambda c: repr({0: None, 1: "fp16", 2: "bf16"}.get(int(c), c))),
            ("bytes_per_pack", self.bytes_per_pack, lambda b: str(int(b))),
            ("number of gradients", len(signature), lambda n: str(int(n))),
            ("gradient shapes/dtypes (CRC32)", zlib.crc32(shapes), lambda c: f"{int(c):08x}"),
            ("sparsity density", getattr(self.sparsity, "density", 0.0), lambda d: f"{d:g}"),
            ("sparsity settings (CRC32)", _sparsity_fingerprint(self.sparsity),
             lambda c: f"{int(c):08x}"),
        ]

    def _check_workers_agree(self, signature, first_values, options):
        """Fixed-shape handshake: a float64 [workers x (1 + fields)] SUM all-reduce.

        Each worker's local replica 0 writes [1, fields...] into its row, everyone
        else zeros; the sum is the table of all workers' settings. It runs eagerly
        (tf.init_scope) while the step is traced, so a mismatch raises a Python
        ValueError before any packed collective exists.
        """
        workers = self._workers
        if workers is None or workers.num_workers == 1:
            return
        settings = self._settings(signature)
        width = 1 + len(settings)
        mine = np.zeros([workers.num_workers, width], np.float64)
        mine[workers.rank] = [1.0] + [float(number) for _, number, _ in settings]
        with tf.init_scope():
            rows = []
            for r, value in enumerate(first_values):
                with tf.device(value.device):
                    rows.append(tf.constant(mine.ravel() if r == 0 else np.zeros(mine.size)))
            pr = tf_internal.per_replica(rows)
            summed = self._cross_ops().batch_reduce(_SUM, [(pr, pr)], options)[0]
            table = tf_internal.local_values(summed)[0].numpy().reshape(mine.shape)
        problems = []
        for k, (name, _, show) in enumerate(settings, start=1):
            column = table[:, k]
            if np.any(column != column[0]) or np.any(table[:, 0] != 1.0):
                listed = ", ".join(f"{worker} = {show(v)}" for worker, v in zip(workers.names, column))
                problems.append(f"{name}: {listed}")
        if problems:
            raise ValueError(
                "gf_tf.GradientFlowAllReduce settings differ across workers (every worker must "
                "use the same compression, bytes_per_pack, sparsity and model): "
                + "; ".join(problems))


class _StepTotals:
    """Per-step sums of the figures that go into CommStats.update (one update per step)."""

    def __init__(self):
        self.dense_bytes = 0
        self.sent_bytes = 0
        self.selected_chunks = 0
        self.total_chunks = 0
        self.residual_norm = None

    def add(self, dense_bytes=0, sent_bytes=0, selected_chunks=0, total_chunks=0,
            residual_norm=None):
        """Same arguments as CommStats.update; residual norms (L1) of the packs add up."""
        self.dense_bytes += dense_bytes
        self.sent_bytes += sent_bytes
        self.selected_chunks += selected_chunks
        self.total_chunks += total_chunks
        if residual_norm is not None:
            self.residual_norm = residual_norm if self.residual_norm is None \
                else self.residual_norm + residual_norm

    def as_kwargs(self):
        return dict(dense_bytes=self.dense_bytes, sent_bytes=self.sent_bytes,
                    selected_chunks=self.selected_chunks, total_chunks=self.total_chunks,
                    residual_norm=self.residual_norm)


def _groups_by_dtype(indices, samples):
    """Splits `indices` into runs of one dtype (IndexedSlices: one group per dtype too),
    ordered by first appearance: TF's collective all-reduce concatenates a batch of
    dense values, which fails for mixed dtypes."""
    groups = {}
    for i, sample in zip(indices, samples):
        kind = (isinstance(sample, tf.IndexedSlices), tf.as_dtype(sample.dtype).name)
        groups.setdefault(kind, []).append(i)
    return list(groups.values())


def _packable_signature(values):
    """(shape, dtype) if these per-replica components can be packed, else None."""
    first = values[0]
    if not isinstance(first, tf.Tensor) or first.dtype not in PACKABLE_DTYPES:
        return None
    if not first.shape.is_fully_defined():
        return None
    if any(not isinstance(v, tf.Tensor) or v.shape != first.shape or v.dtype != first.dtype
           for v in values[1:]):
        return None
    return (first.shape, first.dtype)


def _sparsity_fingerprint(sparsity) -> int:
    if sparsity is None:
        return 0
    if hasattr(sparsity, "get_config"):
        config = sparsity.get_config()
    else:
        config = {k: v for k, v in vars(sparsity).items()
                  if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
    return zlib.crc32(repr((type(sparsity).__name__, sorted(config.items()))).encode())
