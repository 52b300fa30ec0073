"""GradientFlowAllReduce: packed FP16 (and CSC) gradient all-reduce as a tf.distribute.CrossDeviceOps.

TensorFlow's contract only: everything that is not a gradient goes to the
wrapped TensorFlow cross-device ops exactly as the stock strategy sends it; the
two ways TensorFlow runs a replica's gradient all-reduce (merge call, replica
context) meet in one funnel, `gf_tf.route.run`, which runs one variable set's step.
"""

import dataclasses
import time
from typing import List, Optional, Sequence

import tensorflow as tf

from gf_tf import integrations, local_steps as local_steps_lib, plan, route, tf_internal
from gf_tf.plan import AUTO, probe, trial
from gf_tf.reducers import DenseReducer, Reducer
from gf_tf.state import StateRegistry
from gf_tf.stats import CommStats, StepFreeStats

_SUM = tf.distribute.ReduceOp.SUM


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
      (`gf_tf.wire`), so no partial sum overflows and small gradients keep
      FP16's precision at any replica count; the scale is undone after.
    - float IndexedSlices go to the strategy's own gather, as float16 rows
      each scaled by its own power of two (`gf_tf.slices`) where the packs'
      wire is 16-bit, and under compression="auto" across workers.
    - everything else (integers, float64, unknown shapes, None) goes to the
      strategy's own batch all-reduce untouched.

    Per step: one float32 all-reduce of every pack's control values (FP16 scale
    bounds, CSC chunk norms), then one collective per pack (with `overlap`, per group).

    Across workers the settings and the gradient list must agree: a fixed-shape
    float64 all-reduce compares them before the first step of each trace.

    The defaults are the planner's (`gf_tf.plan`): when a
    gf_tf.MultiWorkerMirroredStrategy starts, `gf_tf.plan.probe` measures the
    links and the local packing cost, and each variable set travels the way the
    cost model predicts is fastest: FP16 packs, or TensorFlow's own float32
    all-reduce where latency outweighs bytes; where the model cannot tell them
    apart, both are timed at the set's first trace (`gf_tf.plan.trial`). With one
    worker "auto" is TensorFlow's own all-reduce. `plans()` shows the choice.

    Args:
      compression (str | None): "auto" (default: the planner picks "fp16" packs,
        float32 packs over recursive doubling, or TF's own float32 all-reduce),
        "fp16", "bf16" or None (packing only), or another name
        registered in `gf_tf.wire.FORMATS`. With `sparsity`, "auto" is "fp16".
      bytes_per_pack (int | str): lazy all-reduce threshold in wire bytes (>= 0);
        0 = one pack per dtype. A tensor larger than it gets a pack of its own.
        "auto" (default): 4 MiB (`gf_tf.plan.planner.PACK_SIZES`).
      sparsity (ChunkSparsity | None): optional `gf_tf.ChunkSparsity` (CSC), applied
        to every pack.
      cross_device_ops (tf.distribute.CrossDeviceOps | None): the TensorFlow
        cross-device ops that carry the packs; None = the one the strategy would
        use by itself (MirroredStrategy's CollectiveAllReduce; set by
        gf_tf.MultiWorkerMirroredStrategy).
      algorithm (str): how the packs (and the control vector, CSC's norms and
        chunks) cross workers: "auto" (default: the planner's choice), "ring" (the
        wrapped TF ops, 2(N-1) hops), "recursive_doubling" (ceil(log2 N) rounds
        of 2-member all-reduces, multi-worker runs of
        gf_tf.MultiWorkerMirroredStrategy on the merge-call path; elsewhere the
        ring) or another name registered in `gf_tf.collectives.ALGORITHMS`.
      overlap (bool | str): packs in groups, each with its own control all-reduce,
        so a group's collectives wait only for its own gradients and can run during
        the rest of backprop: False (default: one barrier, every pack waits for
        the step's last gradient), "auto" (the planner's rule,
        `gf_tf.plan.planner.choose_overlap`, which may pick smaller packs when
        bytes_per_pack is "auto"; one barrier when the probe did not run) or
        True (one group per pack). Not the default: each group adds collectives,
        and on one inter-op thread nothing overlaps (docs/overlap.md). Unscaled
        wires and TF's own all-reduce keep one barrier; a reducer groups where
        its `CostTerms.groupable` says (CSC: per-pack selection, fixed density).
      reducer (Reducer | None): a `gf_tf.reducers.Reducer` of your own (the packs'
        step: state, settings, cost terms and the all-reduce); None: the dense
        reducer, or CSC's with `sparsity`.

    Attributes:
      stats: `gf_tf.stats.CommStats`, updated once per gradient all-reduce; created
        on first use (variables initialise the TF runtime, which must wait until
        a MultiWorkerMirroredStrategy has configured its collectives).
      trial_clock: the clock of `gf_tf.plan.trial` (a callable returning seconds;
        `time.perf_counter` by default); replace it before the first trace.

    Raises:
      ValueError: bad compression / bytes_per_pack / algorithm / overlap / sparsity /
        reducer, or cross_device_ops that is itself a GradientFlowAllReduce; at the
        first trace of a step, settings that differ across workers (`gf_tf.agreement`).
    """

    def __init__(self, compression: Optional[str] = AUTO, bytes_per_pack=AUTO, sparsity=None,
                 cross_device_ops: Optional[tf.distribute.CrossDeviceOps] = None,
                 algorithm: str = AUTO, overlap=False, reducer: Optional[Reducer] = None):
        super().__init__()
        self._settings = plan.Settings(compression, bytes_per_pack, algorithm, overlap)
        if isinstance(cross_device_ops, GradientFlowAllReduce):
            raise ValueError("cross_device_ops must be a TensorFlow cross-device ops, "
                             "not another GradientFlowAllReduce")
        if sparsity is not None and not hasattr(sparsity, "reducer"):
            raise ValueError(f"sparsity must be a gf_tf.ChunkSparsity (e.g. "
                             f"gf_tf.ChunkSparsity(density={sparsity!r})), got {sparsity!r}")
        if (reducer is not None and not isinstance(reducer, Reducer)) or (sparsity and reducer):
            raise ValueError(f"reducer must be a gf_tf.reducers.Reducer, and not given beside "
                             f"sparsity (the CSC reducer), got {reducer!r}")
        self.sparsity = sparsity
        self.reducer = sparsity.reducer() if sparsity is not None else reducer or DenseReducer()
        self._costs: Optional[plan.Costs] = None   # measured by gf_tf.plan.probe at _attach
        self._wrapped, self._strategy = cross_device_ops, None   # the strategy whose ops we took
        self._workers = None  # gf_tf.cluster.WorkerInfo, set by gf_tf.MultiWorkerMirroredStrategy
        self._stats = None
        self._states = StateRegistry()
        self.trial_clock = time.perf_counter   # gf_tf.plan.trial's clock (seconds); tests replace it
        self._local_steps = None
        # Keras's gradient all-reduce comes here; Keras's fit fixes (multi-step loop, replicas
        # skipping non-finite steps together) for MirroredStrategy users too.
        integrations.install_all()

    # The settings as given (compression: "auto" or the `gf_tf.wire.WireFormat`), checked.
    compression = property(lambda self: self._settings.compression)
    bytes_per_pack = property(lambda self: self._settings.bytes_per_pack)
    algorithm = property(lambda self: self._settings.algorithm)
    overlap = property(lambda self: self._settings.overlap)

    def __repr__(self):
        compression = self.compression if self.compression == AUTO else self.compression.name
        return (f"GradientFlowAllReduce(compression={compression!r}, "
                f"bytes_per_pack={self.bytes_per_pack!r}, sparsity={self.sparsity!r}, "
                f"algorithm={self.algorithm!r}, overlap={self.overlap!r})")

    @property
    def stats(self) -> CommStats:
        """The `gf_tf.stats.CommStats` of this object, created on first use."""
        if self._stats is None:
            with tf.init_scope():
                self._stats = CommStats()
        return self._stats

    def states(self):
        """{variable-set name: gf_tf.state.VariableSetState} (read-only use), oldest first; a
        name an older set has gets " (#2)", " (#3)", ... appended."""
        return self._states.states()

    @property
    def local_steps(self):
        """The `gf_tf.local_steps.LocalSteps` that makes some gradient all-reduces local (each
        replica keeps its own gradient, no collective; `gf_tf.keras.LocalSGD` sets it while it
        trains), or None. Read when a step is traced."""
        return self._local_steps

    @local_steps.setter
    def local_steps(self, value):
        if value is not None and not isinstance(value, local_steps_lib.LocalSteps):
            raise TypeError(f"local_steps must be a gf_tf.local_steps.LocalSteps or None, "
                            f"got {type(value).__name__}")
        self._local_steps = value

    @property
    def workers(self):
        """The gf_tf.cluster.WorkerInfo (rank, names) set by gf_tf.MultiWorkerMirroredStrategy,
        or None (one worker, or a MirroredStrategy)."""
        return self._workers

    @property
    def state_registry(self) -> StateRegistry:
        """The StateRegistry of every variable set's state (for checkpoint integration)."""
        return self._states

    def reset_states(self) -> None:
        """Drops every variable set's state (CSC residuals, velocities, step counters)."""
        self._states.clear()

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
    def costs(self) -> Optional[plan.Costs]:
        """The planner's measured constants (gf_tf.plan.probe), or None (not measured)."""
        return self._costs

    def plans(self):
        """{variable-set name: gf_tf.plan.PlanReport}: how each set's gradients travel (`.plan`,
        `.forecast`, `.describe()`); for a set under trial (`gf_tf.plan.trial`), once decided,
        the candidate kept with its measured seconds."""
        return {name: trial.report(state.planned, state.trial)
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

    # Everything that is not a gradient: exactly the wrapped ops.
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

    def all_reduce_gradients(self, replica_ctx, grads: List[tf.Tensor], variables: Sequence,
                             reduce_op, options=None) -> List[tf.Tensor]:
        """The gradient all-reduce of one replica (see `gf_tf.all_reduce_gradients`). Both
        ways TensorFlow runs it, merge_call (every CPU run) and the replica context (XLA on
        all-GPU devices), go through `gf_tf.route.run`, so they cannot drift apart."""
        orchestrator = self._orchestrator(self._cross_ops())
        local = None if self._local_steps is None else self._local_steps.local_for(variables)
        if local == local_steps_lib.MEETING:
            orchestrator = dataclasses.replace(orchestrator,
                                               stats=StepFreeStats(self.stats))
            local = None
        if tf_internal.use_merge_call(replica_ctx.strategy):
            def merge_fn(strategy, *per_replica):
                def synchronous():
                    return route.run_merged(orchestrator, strategy, list(per_replica), variables,
                                            reduce_op, options)
                if local is None:
                    return synchronous()
                return local_steps_lib.run_merged(local, strategy, per_replica, reduce_op,
                                                  self.stats, synchronous)
            return replica_ctx.merge_call(merge_fn, args=tuple(grads))
        if local is not None:
            raise ValueError("gf_tf: local steps (gf_tf.keras.LocalSGD) need the merge-call "
                             "gradient all-reduce; this strategy all-reduces in replica context "
                             "(XLA on all-GPU devices): train without jit_compile, or without LocalSGD")
        return route.run_in_replica(orchestrator, replica_ctx, grads, variables, reduce_op,
                                    options)

    @tf.autograph.experimental.do_not_convert   # from a user's tf.function: gf_tf runs as written
    def reduce_locally(self, strategy, grads: Sequence[tf.Tensor], variables: Sequence,
                       reduce_op=_SUM) -> List[tf.Tensor]:
        """One replica's gradient all-reduce through this object's plan, reducer and state,
        every collective the identity: a step's local work (packing, scaling, CSC's chunk
        path) without a network, for benchmarks (`gf_tf.route.run_locally`). Call it in a
        tf.function. grads: this replica's; variables: theirs. Returns per gradient what a
        step of one replica without peers returns.

        Raises:
          ValueError: this object serves a gf_tf.MultiWorkerMirroredStrategy's workers.
        """
        if self._workers is not None:
            raise ValueError("reduce_locally runs without peers; this GradientFlowAllReduce "
                             "serves the workers of a gf_tf.MultiWorkerMirroredStrategy")
        return route.run_locally(self._orchestrator(None), strategy, grads, variables, reduce_op)

    def _orchestrator(self, cross_ops) -> route.Orchestrator:
        return route.Orchestrator(cross_ops, self._workers, self._costs, self._settings,
                                  self.reducer, self._states, self.stats, self.trial_clock)

    def pack_plan(self, signature) -> plan.SetPlan:
        """(the plan and its forecast, the signature it packs, its PackSpecs) of a
        gradient signature (per gradient (shape, dtype), or None where it cannot be packed):
        what a step builds, and a checkpoint restore compares (`gf_tf.plan.plan_set`)."""
        return self._orchestrator(self._wrapped).plan_set(signature)
