"""GradientFlowAllReduce: packed FP16 (and CSC) gradient all-reduce as a tf.distribute.CrossDeviceOps.

Orchestration only: which all-reduces are gradients, the pack plan (`packing`),
the state per variable set (`state`), the reducers (`reducers`, `csc`)
and the collectives of the wrapped TensorFlow cross-device ops.
"""

import dataclasses
import logging
import time
import zlib
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from gf_tf import agreement, collectives, integrations, packing, planner, probe, tf_internal, trial
from gf_tf.agreement import hex_text
from gf_tf.compression import as_compression
from gf_tf.planner import ALGORITHMS, AUTO, DEFAULT_BYTES_PER_PACK, Plan  # noqa: F401
from gf_tf.reducers import Communicator, DenseReducer, PackStep, Sent, StepInput
from gf_tf.state import StateRegistry, VariableSetState
from gf_tf.stats import CommStats

_METHOD_CODES = ("tf", "fp16", "bf16", "none")   # Plan.method, as a number for the handshake
# ... and as the handshake prints it: the compression name a user passes (None: packing only).
_METHOD_TEXT = ("'tf' (TensorFlow's own all-reduce)", "'fp16'", "'bf16'", "None")

_log = logging.getLogger("gf_tf.planner")
_SUM = tf.distribute.ReduceOp.SUM
_MEAN = tf.distribute.ReduceOp.MEAN


class GradientFlowAllReduce(tf.distribute.CrossDeviceOps):
    """Lazy, mixed-precision (and optionally sparse) all-reduce of gradients.

    Source: GradientFlow (arXiv 1902.06855): lazy all-reduce, mixed-precision
    communication, coarse-grained sparse communication. Mirrors the contract
    of `tf.distribute.NcclAllReduce`: pass an instance as
    `tf.distribute.MirroredStrategy(cross_device_ops=...)`, or use
    `gf_tf.MultiWorkerMirroredStrategy`.

    Only gradients are compressed: the all-reduce the Keras optimizer issues
    (`model.fit`, and `optimizer.apply_gradients` in custom loops) and those a
    custom loop sends through `gf_tf.all_reduce_gradients`. Every other
    all-reduce (`ReplicaContext.all_reduce`: SyncBatchNorm statistics, metric
    and loss sums, counts, users' own; `strategy.reduce`, `broadcast`,
    `gather`) goes to the wrapped TF ops exactly as the stock strategy sends it.

    Gradients:
    - dense float16/bfloat16/float32 tensors with static shapes are packed per
      dtype into 1-D buffers of at most `bytes_per_pack` wire bytes, in backprop
      order (reverse of the caller's order); float32 travels as
      `compression`'s dtype. On a float16 wire each tensor is multiplied by a
      power of two chosen from the all-reduced SUM of every replica's max |g|
      (`gf_tf.compression`), so no partial sum overflows and small gradients
      keep FP16's precision at any replica count; the scale is undone after.
    - everything else (IndexedSlices, integers, float64, unknown shapes) goes
      to the strategy's own batch all-reduce untouched; None stays None.
    Per step: one float32 all-reduce of every pack's control values (FP16
    scale bounds, CSC chunk norms), then one collective per pack; or, with
    `overlap`, per group of FP16 packs its own bounds' all-reduce, then its
    packs' (`gf_tf.reducers.group_ranges`).

    Across workers the settings and the gradient list must agree: before the
    first step of each trace a fixed-shape float64 all-reduce compares them
    and raises ValueError naming the setting and the workers.

    The defaults are the planner's (`gf_tf.planner`): when a
    gf_tf.MultiWorkerMirroredStrategy starts, `gf_tf.probe` measures the
    link's per-hop latency and bandwidth and the local packing cost (1-4 s
    here), and each variable set then travels the way the cost model
    predicts is fastest: FP16 packs, or TensorFlow's own float32 all-reduce
    where latency outweighs bytes (small sets, fast links, many workers), over
    the ring or recursive doubling. Where the model cannot tell the two apart
    (`gf_tf.planner.TRIAL_BAND`), both are timed on the set's shapes while its
    step is first traced, and every worker keeps the same, faster one
    (`gf_tf.trial`); the step carries only that one.
    With one worker there is no network to save: "auto" is TensorFlow's own
    all-reduce. `plans()` shows the choice.

    Args:
      compression: "auto" (default: the planner picks "fp16" or TF's own
        float32), "fp16", "bf16" or None (packing only). With `sparsity`,
        "auto" is "fp16".
      bytes_per_pack: lazy all-reduce threshold in wire bytes (>= 0); 0 = one
        pack per dtype. A tensor larger than it gets a pack of its own.
        "auto" (default): 4 MiB (`gf_tf.planner.PACK_SIZES`: measured faster
        than one pack here on ResNet-50-sized gradients).
      sparsity: optional `gf_tf.ChunkSparsity` (CSC), applied to every pack.
      cross_device_ops: the TensorFlow cross-device ops that carry the packs;
        None = the one the strategy would use by itself (MirroredStrategy's
        CollectiveAllReduce; set by gf_tf.MultiWorkerMirroredStrategy).
      algorithm: how the packs (and the per-step control vector, CSC's norms
        and chunks) cross workers: "auto" (default: the planner's choice),
        "ring" (the wrapped TF ops, 2(N-1) hops) or "recursive_doubling"
        (`gf_tf.collectives`: ceil(log2 N) rounds of 2-member all-reduces, for
        small, latency-bound packs). It applies to multi-worker runs of
        gf_tf.MultiWorkerMirroredStrategy on the merge-call path (every CPU
        run); one worker has nothing to double and uses the ring, as does the
        replica-context path (XLA on all-GPU devices) with several local replicas.
      overlap: FP16 packs in groups, each with its own scale bounds' all-reduce,
        so a group's collectives wait only for its own gradients and can run
        during the rest of backprop: False (default: one barrier, every pack
        waits for the step's last gradient), "auto" (the planner's rule,
        `gf_tf.planner.choose_overlap`, which may pick smaller packs when
        bytes_per_pack is "auto"; one barrier when nothing was measured) or
        True (one group per pack). Not the default: measured here on
        workers pinned to one core, TF's one inter-op thread ran every group's
        first op after backprop's last, so nothing overlapped (with 2 threads
        the groups left during backprop, but the step was not faster), and the
        extra collectives cost 6-7% on ResNet-50 (README "Overlap"). Other wires
        (BF16, float32 packs) have no bounds to wait for; TF's own all-reduce
        keeps one barrier. With `sparsity` at a fixed density and per-pack
        selection (`ChunkSparsity.overlaps`), each group of packs all-reduces
        its own chunk norms, then its own chunks ("auto":
        `gf_tf.planner.choose_sparse_groups`); global selection and
        density="auto" keep one barrier.

    Attributes:
      stats: `gf_tf.stats.CommStats`, updated once per gradient all-reduce.
        Its variables are created on first use, not in the constructor:
        creating variables initialises the TF runtime, which must not happen
        before a MultiWorkerMirroredStrategy configures its collectives.
      trial_clock: the clock of `gf_tf.trial` (a callable returning seconds;
        `time.perf_counter` by default); replace it before the first trace.

    Raises:
      ValueError: bad compression / bytes_per_pack / algorithm / overlap; settings
        differing across workers.
    """

    def __init__(self, compression: Optional[str] = AUTO, bytes_per_pack=AUTO, sparsity=None,
                 cross_device_ops: Optional[tf.distribute.CrossDeviceOps] = None,
                 algorithm: str = AUTO, overlap=False):
        super().__init__()
        self.compression = AUTO if compression == AUTO else as_compression(compression)
        if bytes_per_pack != AUTO and (
                isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, (int, np.integer))
                or bytes_per_pack < 0):
            raise ValueError(f"bytes_per_pack must be \"auto\" or an integer number of bytes >= 0, "
                             f"got {bytes_per_pack!r}")
        if algorithm != AUTO and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be \"auto\" or one of {list(ALGORITHMS)}, "
                             f"got {algorithm!r}")
        if isinstance(cross_device_ops, GradientFlowAllReduce):
            raise ValueError("cross_device_ops must be a TensorFlow cross-device ops, "
                             "not another GradientFlowAllReduce")
        self.bytes_per_pack = AUTO if bytes_per_pack == AUTO else int(bytes_per_pack)
        self.algorithm = algorithm
        self.overlap = planner.check_overlap(overlap)
        self.sparsity = sparsity
        self._costs: Optional[planner.Costs] = None   # measured by gf_tf.probe at _attach
        self.reducer = sparsity.reducer() if sparsity is not None else DenseReducer()
        self._wrapped = cross_device_ops
        self._workers = None  # gf_tf.strategy.WorkerInfo, set by gf_tf.MultiWorkerMirroredStrategy
        self._stats = None
        self._strategy = None  # the strategy whose default ops we took
        self._states = StateRegistry()
        self.trial_clock = time.perf_counter   # gf_tf.trial's clock (seconds); tests replace it
        # Keras's gradient all-reduce comes here; Keras's fit fixes (multi-step loop, replicas
        # skipping non-finite steps together) for MirroredStrategy users too.
        integrations.install_all()

    def __repr__(self):
        compression = self.compression if self.compression == AUTO else self.compression.name
        return (f"GradientFlowAllReduce(compression={compression!r}, "
                f"bytes_per_pack={self.bytes_per_pack!r}, sparsity={self.sparsity!r}, "
                f"algorithm={self.algorithm!r}, overlap={self.overlap!r})")

    @property
    def stats(self) -> CommStats:
        if self._stats is None:
            with tf.init_scope():
                self._stats = CommStats()
        return self._stats

    def states(self):
        """{variable-set name: gf_tf.state.VariableSetState}: plan and per-pack state (read-only use).

        Oldest first; a set whose name an older one has gets " (#2)", " (#3)", ... appended."""
        return self._states.states()

    @property
    def workers(self):
        """The gf_tf.strategy.WorkerInfo (rank, names) set by gf_tf.MultiWorkerMirroredStrategy,
        or None (one worker, or a MirroredStrategy)."""
        return self._workers

    @property
    def state_registry(self) -> StateRegistry:
        """The StateRegistry of every variable set's state (for checkpoint integration)."""
        return self._states

    def reset_states(self) -> None:
        """Drops every variable set's state (CSC residuals, velocities, step counters)."""
        self._states.clear()

    # --- wiring -------------------------------------------------------------

    def _attach(self, wrapped, workers, devices=(), options=None):
        """Called by gf_tf.MultiWorkerMirroredStrategy: wrap its CollectiveAllReduce, and
        measure the planner's constants when a setting is "auto" and there are peers."""
        if self._wrapped is not None or self._workers is not None:
            raise ValueError("gf_tf.MultiWorkerMirroredStrategy needs a GradientFlowAllReduce of "
                             "its own, built with cross_device_ops=None (it wraps the strategy's "
                             "CollectiveAllReduce); this one already has cross-device ops")
        self._wrapped, self._workers = wrapped, workers
        self.stats  # pylint: disable=pointless-statement  # now, outside any scope and trace
        planned = AUTO in (self.compression, self.bytes_per_pack, self.algorithm)
        if planned and devices and workers.num_workers > 1:
            self._costs = probe.measure(wrapped, devices, options, workers)

    @property
    def costs(self) -> Optional[planner.Costs]:
        """The planner's measured constants (gf_tf.probe), or None (not measured)."""
        return self._costs

    def plans(self):
        """{variable-set name: gf_tf.planner.Plan}: how each set's gradients travel; for a set
        under trial (`gf_tf.trial`), once decided, the candidate kept with its measured seconds."""
        return {name: trial.effective_plan(state.transport, state.trial)
                for name, state in self._states.states().items()}

    def _cross_ops(self) -> tf.distribute.CrossDeviceOps:
        if self._wrapped is None:
            strategy = tf.distribute.get_strategy()
            self._wrapped = tf_internal.default_cross_device_ops(strategy)
            self._strategy = strategy
        elif self._strategy is not None and self._strategy is not tf.distribute.get_strategy():
            raise ValueError("this GradientFlowAllReduce already carries the collectives of another "
                             "strategy; create one GradientFlowAllReduce per strategy")
        return self._wrapped

    @property
    def _num_between_graph_workers(self):
        return tf_internal.num_workers_of(self._wrapped) if self._wrapped is not None else 1

    # --- everything that is not a gradient: exactly the wrapped ops -----------

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self._cross_ops().batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                             options)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._cross_ops().reduce_implementation(reduce_op, per_replica_value,
                                                       destinations, options)

    def broadcast_implementation(self, tensor, destinations):
        return self._cross_ops().broadcast_implementation(tensor, destinations)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return tf_internal.gather(self._cross_ops(), per_replica_value, destinations, axis,
                                  options)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        return tf_internal.replica_all_reduce(self._cross_ops(), reduce_op, value, replica_id,
                                              options)

    # --- gradients ------------------------------------------------------------

    def all_reduce_gradients(self, replica_ctx, grads: List[tf.Tensor], variables: Sequence,
                             reduce_op, options=None) -> List[tf.Tensor]:
        """The gradient all-reduce of one replica (see `gf_tf.all_reduce_gradients`).

        Both ways TensorFlow runs a replica's all-reduce go through `_reduce`:
        merge_call (every CPU run) and the replica context (XLA on all-GPU
        devices), so they cannot drift apart.
        """
        strategy = replica_ctx.strategy
        self._cross_ops()
        if tf_internal.use_merge_call(strategy):
            def merge_fn(strategy, *per_replica):
                return self._reduce_merged(strategy, list(per_replica), variables, reduce_op,
                                           options)
            return replica_ctx.merge_call(merge_fn, args=tuple(grads))
        return self._reduce_in_replica(replica_ctx, grads, variables, reduce_op, options)

    def _reduce_merged(self, strategy, per_replica, variables, reduce_op, options):
        grads = [tf_internal.local_values(v) for v in per_replica]
        num_local = len(grads[0])
        tf_internal.check_not_xla_across_devices(num_local)

        def all_reduce_sum(tensors):
            pr = tf_internal.per_replica(tensors)
            reduced = strategy.extended.batch_reduce_to(_SUM, [(pr, pr)], options)[0]
            return tf_internal.local_values(reduced)

        def others(indices):
            pairs = [(per_replica[i], per_replica[i]) for i in indices]
            reduced = strategy.extended.batch_reduce_to(reduce_op, pairs, options)
            return [tf_internal.local_values(r) for r in reduced]

        per_local = [[g[r] for g in grads] for r in range(num_local)]
        results = self._reduce(strategy, per_local, tuple(range(num_local)), variables,
                               reduce_op, all_reduce_sum, others, options)
        return [tf_internal.mirrored([results[r][i] for r in range(num_local)])
                for i in range(len(per_replica))]

    def _reduce_in_replica(self, replica_ctx, grads, variables, reduce_op, options):
        num_local = len(replica_ctx.strategy.extended.worker_devices)
        replica_id = tf.get_static_value(replica_ctx.replica_id_in_sync_group)
        if replica_id is None:
            raise ValueError("gf_tf: the replica id is not known while tracing; the replica-context "
                             "gradient all-reduce needs a static one (tf.distribute strategies give it)")
        local = int(replica_id) % num_local

        def all_reduce_sum(tensors):
            return [replica_ctx.all_reduce(_SUM, tensors[0], options)]

        def others(indices):
            reduced = replica_ctx.all_reduce(reduce_op, [grads[i] for i in indices], options)
            return [[r] for r in reduced]

        return self._reduce(replica_ctx.strategy, [list(grads)], (local,), variables,
                            reduce_op, all_reduce_sum, others, options)[0]

    def _reduce(self, strategy, grads, replicas, variables, reduce_op, all_reduce_sum, others,
                options):
        """The one funnel. grads: per served replica, the caller's gradient list.

        Returns per served replica the reduced list (packs through the
        reducer, the rest through `others`, one batch per dtype).
        """
        signature = [packing.packable_signature([g[i] for g in grads])
                     for i in range(len(grads[0]))]
        packable = [i for i, entry in enumerate(signature) if entry is not None]
        transport, signature, plan = self.pack_plan(signature)
        devices = list(strategy.extended.worker_devices)
        state = self._states.get(list(variables), signature, plan,
                                 lambda packs: self.reducer.create_states(packs, devices))
        if state.transport != transport:
            state.transport = transport
            _log.info("gf_tf: variable set [%s] travels as %s", state.set_name, transport.describe())
        if replicas[0] == 0 and self._workers is not None:
            agreement.check_workers_agree(self._workers, self._settings(state), devices,
                                          self._cross_ops(), options)
        comm = Communicator(self._collective(transport.algorithm, all_reduce_sum, devices, replicas,
                                             options),
                            strategy.num_replicas_in_sync, reduce_op == _MEAN, replicas,
                            tuple(devices[r] for r in replicas))
        results = [[None] * len(signature) for _ in grads]
        if transport.method == "tf" or (transport.trial and self._trial_choice(
                state, grads, packable, comm, devices, options) == trial.TF_OWN):
            sent = _sent_by_tf([grads[0][i] for i in packable])
            rest = list(range(len(signature)))   # every gradient by TF's own all-reduce
        else:
            sent = self._reduce_packs(state, grads, comm, results)
            rest = [i for i, entry in enumerate(signature) if entry is None]
        _reduce_by_tf(grads, rest, others, results)
        if packable and replicas[0] == 0:
            self.stats.update(**vars(sent))
        return results

    def pack_plan(self, signature):
        """(the gf_tf.planner.Plan, the signature it packs, its PackSpecs) of a gradient
        signature (per gradient (shape, dtype), or None where it cannot be packed): what a
        step builds, and a checkpoint restore compares. TF's own all-reduce packs nothing."""
        transport = self._plan(signature)
        if transport.method == "tf":
            signature = [None] * len(signature)   # every gradient goes to TF's own all-reduce
        wire = as_compression(transport.compression)
        packs = packing.plan_packs(signature, transport.bytes_per_pack, wire.wire_dtype)
        live = sum(1 for p in packs if p.num_elements)
        if self.sparsity is None:
            return planner.with_pack_count(transport, live, self.overlap), signature, packs
        elements = sum(p.num_elements for p in packs)
        groups = planner.choose_sparse_groups(
            live, *self.sparsity.step_bytes(elements), self._num_workers(), self._costs,
            transport.algorithm, self.overlap if self.sparsity.overlaps else False)
        return dataclasses.replace(transport, groups=groups), signature, packs

    def _plan(self, signature) -> Plan:
        """The planner's transport of this gradient list (gf_tf.planner), the pinned settings kept."""
        packable = [entry for entry in signature if entry is not None]
        elements = sum(int(shape.num_elements()) for shape, _ in packable)
        workers = self._num_workers()
        if self.compression == AUTO:
            method = AUTO if self.sparsity is None else "fp16"
        else:
            method = self.compression.name or "none"
        if self.sparsity is None:
            return planner.choose(elements, len(packable), workers, self._costs, method,
                                  self.algorithm, self.bytes_per_pack, self.overlap)
        bytes_per_pack = DEFAULT_BYTES_PER_PACK if self.bytes_per_pack == AUTO else self.bytes_per_pack
        norm_bytes, chunk_bytes = self.sparsity.step_bytes(elements)
        algorithm = planner.choose_sparse_algorithm(norm_bytes, chunk_bytes, workers, self._costs,
                                                    self.algorithm)
        return Plan(method, bytes_per_pack, algorithm)

    def _trial_choice(self, state: VariableSetState, grads, packable, comm: Communicator,
                      devices, options) -> int:
        """trial.TF_OWN or trial.GRADIENT_FLOW: the set's trial decision (`gf_tf.trial`), timed
        at its first trace where every local replica is served (the merge-call path); else
        the model's pick (the replica-context path: one replica a call)."""
        if len(comm.replicas) != len(devices):
            faster = state.transport.seconds <= state.transport.tf_seconds
            return trial.GRADIENT_FLOW if faster else trial.TF_OWN
        if state.trial is None:
            state.trial = self._measure_trial(state, [[g[i] for i in packable] for g in grads],
                                              packable, comm, options)
        return state.trial.choice

    def _measure_trial(self, state: VariableSetState, grads, packable, comm: Communicator,
                       options) -> trial.Decision:
        """Runs the set's trial eagerly on tensors shaped like its packable gradients `grads`
        (per served replica), on their devices."""
        cross_ops, size = self._cross_ops(), len(state.signature)

        def as_gradient_list(inputs):   # per replica, the packable ones at their indices
            out = [[None] * size for _ in inputs]
            for r, replica in enumerate(inputs):
                for i, value in zip(packable, replica):
                    out[r][i] = value
            return out

        def by_tf(indices, values):   # per index in `indices`, per replica: the SUM of values[r][i]
            pairs = [(pr, pr) for pr in (tf_internal.per_replica([replica[i] for replica in values])
                                         for i in indices)]
            return [tf_internal.local_values(r) for r in cross_ops.batch_reduce(_SUM, pairs, options)]

        @tf.function
        def tf_own(inputs):
            values, out = as_gradient_list(inputs), [[None] * size for _ in inputs]
            _reduce_by_tf(values, packable, lambda indices: by_tf(indices, values), out)
            return out

        @tf.function
        def gradient_flow(inputs):
            out = [[None] * size for _ in inputs]
            self._reduce_packs(state, as_gradient_list(inputs), comm, out)
            return out

        ring = probe.ring_sum(cross_ops, options or tf.distribute.experimental.CommunicationOptions())

        def mean(mine):
            return probe.mean_over_workers(ring, comm.devices, mine, self._workers.num_workers)

        with tf.init_scope():
            inputs = []
            for device, replica in zip(comm.devices, grads):
                with tf.device(device):
                    inputs.append([tf.fill(g.shape, tf.constant(1e-3, g.dtype)) for g in replica])
            return trial.measure([lambda: tf_own(inputs), lambda: gradient_flow(inputs)], mean,
                                 state.set_name, self.trial_clock)

    def _num_workers(self) -> int:
        return self._workers.num_workers if self._workers is not None else 1

    def _collective(self, algorithm, ring_sum, devices, replicas, options):
        """The Communicator's all_reduce_sum for `algorithm`: the wrapped TF ops' ring, or
        gf_tf.collectives' recursive doubling (multi-worker runs)."""
        doubles = (algorithm == collectives.RECURSIVE_DOUBLING and self._workers is not None
                   and self._workers.num_workers > 1 and len(replicas) == len(devices))
        if not doubles:   # recursive doubling sums every local replica before its rounds
            return ring_sum
        return collectives.recursive_doubling_sum(self._cross_ops(), self._workers,
                                                  [devices[r] for r in replicas], options)

    def _reduce_packs(self, state: VariableSetState, grads, comm: Communicator, results) -> Sent:
        """Hands the reducer the packs with elements (one record of the step); an empty pack's
        values are zeros of their shapes."""
        live = [p for p, pack in enumerate(state.plan) if pack.num_elements]
        for pack in state.plan:
            if not pack.num_elements:
                for r in range(len(grads)):
                    for i, shape, dtype in zip(pack.indices, pack.shapes, pack.dtypes):
                        results[r][i] = tf.zeros(shape, dtype)
        if not live:
            return Sent()
        step = StepInput(tuple(PackStep(state.plan[p], [[g[i] for i in state.plan[p].indices]
                                                        for g in grads], state.packs[p])
                               for p in live), state.shared, comm, state.transport.groups)
        outputs, sent = self.reducer.reduce(step)
        for pack, per_replica in zip(step.packs, outputs):
            for r, reduced in enumerate(per_replica):
                for i, value in zip(pack.spec.indices, reduced):
                    results[r][i] = value
        return sent

    def _settings(self, state: VariableSetState):
        """The fields every worker must agree on, as (name, number, how to print it)."""
        shapes = repr([None if s is None else (tuple(s[0].as_list()), s[1].name)
                       for s in state.signature]).encode()
        transport = state.transport
        return [
            ("compression", _METHOD_CODES.index(transport.method),
             lambda c: _METHOD_TEXT[int(c)]),
            ("bytes_per_pack", transport.bytes_per_pack, lambda b: str(int(b))),
            ("algorithm", ALGORITHMS.index(transport.algorithm),
             lambda a: repr(ALGORITHMS[int(a)])),
            ("overlap groups", transport.groups, lambda g: str(int(g))),
            ("trial against TensorFlow's own", int(transport.trial), lambda t: str(bool(t))),
            ("number of gradients", len(state.signature), lambda n: str(int(n))),
            ("gradient shapes/dtypes (CRC32)", zlib.crc32(shapes), hex_text),
        ] + self.reducer.handshake_settings()



def _reduce_by_tf(grads, indices, others, results) -> None:
    """results[r][i] for i in `indices`: the wrapped TF ops' all-reduce, one batch per dtype."""
    for group in packing.groups_by_dtype(indices, [grads[0][i] for i in indices]):
        for i, reduced in zip(group, others(group)):
            for r, value in enumerate(reduced):
                results[r][i] = value


def _sent_by_tf(grads) -> Sent:
    """What TF's own all-reduce of these gradients sends (its dtypes, float32 dense equivalent)."""
    elements = [int(g.shape.num_elements() or 0) for g in grads]
    return Sent(dense_bytes=4 * sum(elements),
                sent_bytes=sum(n * g.dtype.size for n, g in zip(elements, grads)))
