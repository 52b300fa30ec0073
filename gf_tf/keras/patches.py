"""Every private Keras name gf_tf touches, in one table, installed by one function.

`PATCHES` lists the Keras functions gf_tf wraps: target module, attribute, the
Keras flavours it applies to (gf_tf.keras.flavour) and the reason. Each wrapper
delegates to Keras's own code outside the case it fixes. `install()` applies
those the running Keras needs, once. `OVERRIDES` lists the private Keras names
that gf_tf's own subclasses define or derive from (gf_tf/keras/checkpoint.py, backup.py).

Keras 3 (`keras`, the minors of flavour.TESTED_KERAS_VERSIONS; the table follows the private code of
3.6-3.15, and `since`/`before` mark a patch for the minors it applies to):
its TensorFlow trainer fails under
`tf.distribute.MultiWorkerMirroredStrategy` (public report keras-team/keras#20585):
  1. `TensorFlowTrainer._maybe_symbolic_build` calls
     `strategy.reduce("MEAN", <tuple of PerReplica>)` on a data batch:
     "Attempt to convert a value (PerReplica:{...}) to a Tensor". The build only
     needs the batch's structure and shapes, so we hand it local replica 0's batch.
  2. `trainer.reduce_per_replica` reduces the (scalar) logs with
     `strategy.reduce("MEAN", v, axis=0)`: "Invalid reduction dimension 0 for input
     with 0 dimensions". For scalars we reduce with axis=None (the mean over
     replicas); other values keep Keras's behaviour.
  3. `steps_per_execution > 1` fails under Mirrored strategies ("You must feed a value for
     placeholder tensor 'while/.../Placeholder_1'"; stock TF too): Keras 3.7 on call the one-step
     tf.function in a `tf.cond`; we inline it (`_TensorFlowInliningOneStep`). Keras 3.6's loop and
     3.7 on's single step count a step past the data's end: gf_tf.keras.multi_step rebuilds them.
  4. `gradient_accumulation_steps > 1` fails under those strategies ("`merge_call` called
     while defining a new graph"): the all-reduce sits in a `tf.cond`. Under a
     GradientFlowAllReduce, `BaseOptimizer._backend_apply_gradients` takes that
     cond in cross-replica context instead (`_patched_backend_apply_gradients`) and it trains;
     elsewhere we raise a clear ValueError at fit time (Keras 3.6: from `make_train_function`).
  Patches 1-2 are active only for a MultiWorkerMirroredStrategy in multi-worker
  mode, 3-4 for MirroredStrategy and MultiWorkerMirroredStrategy.
tf-keras (`tf_keras`, Keras 2): its multi-worker `fit` needs none of these fixes; its one step
(steps_per_execution=1) counts a step past the data's end as Keras 3's does, and
gf_tf.keras.multi_step guards it under Mirrored strategies (`Model.make_train_function`).

Gradients reach GradientFlow through one hook per flavour, each calling
`gf_tf.all_reduce_gradients` when the strategy's cross-device ops are a
GradientFlowAllReduce, and Keras's own code otherwise:
- Keras 3: `TFOptimizer._all_reduce_sum_gradients`, the optimizer's one gradient all-reduce;
- tf-keras: `Optimizer.aggregate_gradients` and `OptimizerV2._aggregate_gradients`, which
  otherwise call `optimizer_utils.all_reduce_sum_gradients` (`all_reduce(SUM)` or
  `batch_reduce_to(SUM, grads_and_vars)`); its LossScaleOptimizers delegate to them.
Three more Keras 3 patches: `TFOptimizer.build` (CSC state in the optimizer's checkpoint,
gf_tf.keras.checkpoint.attach), `saving_lib._raise_loading_failure` (a CSC state mismatch
is explained first) and `LossScaleOptimizer._tf_apply` (replicas skip non-finite steps together).
"""

import dataclasses
import functools
import importlib
import threading
from typing import Callable, Tuple

import tensorflow as tf

from gf_tf import cluster
from gf_tf.keras import multi_step
from gf_tf.keras.flavour import KERAS3, TF_KERAS, keras_module, patched_flavours

_MAKE_FUNCTION_LOCK = threading.Lock()
_MARK = "_gf_tf_patch"   # set on each installed wrapper: install() is idempotent


@dataclasses.dataclass(frozen=True)
class Patch:
    """`module`.`attribute` ("Class.method", or a module's function) replaced by `wrap(original)`."""
    module: str
    attribute: str
    flavours: Tuple[str, ...]           # gf_tf.keras.flavour.KERAS3 / TF_KERAS
    wrap: Callable[[Callable], Callable]
    reason: str
    since: str = None                   # Keras 3 patches: the first minor ("3.7") it applies to
    before: str = None                  # and the first minor it no longer applies to


@dataclasses.dataclass(frozen=True)
class Override:
    """A private Keras name that a gf_tf class defines or derives from (not patched in place)."""
    module: str
    attribute: str
    by: str        # the gf_tf class that overrides it
    reason: str


def install() -> None:
    """Installs every patch of PATCHES the running Keras needs, once (idempotent).

    Called through gf_tf.integrations by GradientFlowAllReduce (so before Keras traces
    a step with it) and by gf_tf.MultiWorkerMirroredStrategy (the fit fixes serve it
    without GradientFlow too). The running flavour's patches; Keras 3 models (`import
    keras`) may also run in a tf-keras process, so a tested Keras 3 is patched there too.
    Raises RuntimeError on an untested Keras.
    """
    flavours = patched_flavours()
    for patch in PATCHES:
        if flavours.intersection(patch.flavours) and applies_to_running_keras(patch):
            _apply(patch)


def _minor(version: str) -> Tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def keras3_minor() -> Tuple[int, int]:
    """(3, N) of the installed Keras 3, the one the KERAS3 patches wrap (also in a tf-keras process)."""
    return _minor(importlib.import_module("keras").__version__)


def applies_to_running_keras(patch: Patch) -> bool:
    """False for a Keras 3 patch whose `since`/`before` range excludes the installed Keras 3."""
    if patch.since is None and patch.before is None:
        return True
    running = keras3_minor()
    return ((patch.since is None or running >= _minor(patch.since))
            and (patch.before is None or running < _minor(patch.before)))


def _apply(patch: Patch) -> None:
    owner = importlib.import_module(patch.module)
    *path, name = patch.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    replacement = patch.wrap(original)
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)


def in_multi_worker_mode(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy spanning more than one worker."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and cluster.of_strategy(strategy).is_multi_worker)


def _patched_tf_keras_aggregate_gradients(original):
    """tf-keras's aggregation, or gf_tf.all_reduce_gradients under a GradientFlowAllReduce.

    A legacy optimizer given its own `gradient_aggregator` keeps it.
    """
    @functools.wraps(original)
    def aggregate_gradients(self, grads_and_vars):
        from gf_tf import gradients  # pylint: disable=import-outside-toplevel
        from tf_keras.src.optimizers import utils as optimizer_utils  # pylint: disable=import-outside-toplevel
        replica_ctx = tf.distribute.get_replica_context()
        custom = getattr(self, "gradient_aggregator", optimizer_utils.all_reduce_sum_gradients)
        if (replica_ctx is None or custom is not optimizer_utils.all_reduce_sum_gradients
                or not gradients.uses_gradient_flow(replica_ctx.strategy)):
            return original(self, grads_and_vars)
        pairs = list(grads_and_vars)
        present = [(g, v) for g, v in pairs if g is not None]
        reduced = iter(gradients.all_reduce_gradients([g for g, _ in present],
                                                      [v for _, v in present]))
        return [(None if g is None else next(reduced), v) for g, v in pairs]
    return aggregate_gradients


def _patched_all_reduce_sum_gradients(original):
    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        from gf_tf import gradients  # pylint: disable=import-outside-toplevel
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None or not gradients.uses_gradient_flow(replica_ctx.strategy):
            return original(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        reduced = gradients.all_reduce_gradients(grads, [v for _, v in grads_and_vars])
        return list(zip(reduced, [v for _, v in grads_and_vars]))
    return _all_reduce_sum_gradients


def _patched_symbolic_build(original):
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self.distribute_strategy
        if iterator is None or not in_multi_worker_mode(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        # Keras 3.6 yields (step, iterator) from enumerate_epoch(), 3.7-3.10 (step, iterator)
        # from iteration, 3.11 on (begin_step, end_step, iterator): the iterator comes last.
        steps = iterator.enumerate_epoch() if keras3_minor() < (3, 7) else iterator
        for step in steps:
            batch = next(step[-1])
            data_batch = tf.nest.map_structure(
                lambda x: strategy.experimental_local_results(x)[0]
                if isinstance(x, tf.distribute.DistributedValues) else x, batch)
            break
        return original(self, iterator=None, data_batch=data_batch)
    return _maybe_symbolic_build


def _replicated(strategy) -> bool:
    """True for the strategies gf_tf serves: MirroredStrategy and MultiWorkerMirroredStrategy."""
    return isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy))


def _accumulates_under_gradient_flow(strategy) -> bool:
    """True where `_patched_backend_apply_gradients` makes accumulation train: a GradientFlowAllReduce
    carries the strategy's all-reduce and the running Keras is one that patch was tested with."""
    from gf_tf import gradients  # pylint: disable=import-outside-toplevel
    return gradients.uses_gradient_flow(strategy) and applies_to_running_keras(_ACCUMULATION_PATCH)


def _refuse_gradient_accumulation(model) -> None:
    """Keras 3.6-3.15 all-reduce accumulated gradients inside a `cond` (merge_call there fails).

    Accumulation trains where `_accumulates_under_gradient_flow`, without EMA (`use_ema=True`,
    which the accumulation patch does not cover); elsewhere a ValueError naming the fix.
    """
    optimizer = getattr(model, "optimizer", None)
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps or steps <= 1:
        return
    gradient_flow = _accumulates_under_gradient_flow(model.distribute_strategy)
    if gradient_flow and not getattr(optimizer, "use_ema", False):
        return
    where = (" and use_ema=True (gf_tf makes accumulation train without EMA only)" if gradient_flow
             else " (gf_tf makes it train under a GradientFlowAllReduce)")
    raise ValueError(
        f"gradient_accumulation_steps={steps} does not work under "
        f"{type(model.distribute_strategy).__name__} with Keras {keras_module().__version__}"
        f"{where}: the optimizer all-reduces the accumulated gradients inside a tf.cond, where "
        f"tf.distribute cannot merge_call (TensorFlow fails with '`merge_call` called while "
        f"defining a new graph'). Use gradient_accumulation_steps=None and a global batch "
        f"{steps}x larger (more replicas or a larger per-replica batch) instead.")


class _TensorFlowInliningOneStep:
    """Stands for the tensorflow module while Keras's `_make_function` runs.

    `tf.function(one_step_on_data)` returns the function itself, so the multi-step loop
    calls `strategy.run` directly instead of a nested tf.function inside its `tf.cond`,
    which under MirroredStrategy fails with "You must feed a value for placeholder tensor
    'while/.../Placeholder_1'". Everything else is the real module.
    """

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def function(self, func=None, **kwargs):
        if getattr(func, "__name__", "") == "one_step_on_data":
            return func
        return self._module.function(func, **kwargs)


def _patched_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        if not _replicated(self.distribute_strategy):
            return original(self, step_function)
        _refuse_gradient_accumulation(self)
        if self.run_eagerly or self.jit_compile:
            return original(self, step_function)
        if self.steps_per_execution <= 1:   # Keras's one step counts a step past the data
            return multi_step.guarded_function(self, step_function, original(self, step_function))
        from keras.src.backend.tensorflow import trainer as tf_trainer  # pylint: disable=import-outside-toplevel
        with _MAKE_FUNCTION_LOCK:
            tf_trainer.tf = _TensorFlowInliningOneStep(tf)
            try:
                return original(self, step_function)
            finally:
                tf_trainer.tf = tf
    return _make_function


def _patched_make_train_function(original):
    """Keras 3.6 (no `_make_function`): `_patched_make_function`'s refusal and guarded steps."""
    @functools.wraps(original)
    def make_train_function(self, force=False):
        if not _replicated(self.distribute_strategy):
            return original(self, force=force)
        _refuse_gradient_accumulation(self)
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force=force)
        if not self.run_eagerly and not self.jit_compile:
            self.train_function = multi_step.guarded_function(self, self.train_step)
        return self.train_function
    return make_train_function


def _patched_tf_keras_make_train_function(original):
    """tf-keras: its one-step train function, guarded (gf_tf.keras.multi_step)."""
    @functools.wraps(original)
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force=force)
        one_step = (self._steps_per_execution is None  # pylint: disable=protected-access
                    or self._steps_per_execution.numpy().item() == 1  # pylint: disable=protected-access
                    and not self.autotune_steps_per_execution)
        if (_replicated(self.distribute_strategy) and one_step and not self.run_eagerly
                and not self.jit_compile and not self._cluster_coordinator):  # pylint: disable=protected-access
            self.train_function = multi_step.guarded_tf_keras_train_function(self)
            self.train_tf_function = self.train_function.tf_function
        return self.train_function
    return make_train_function


def _patched_reduce_per_replica(original):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not in_multi_worker_mode(strategy):
            return original(values, strategy, reduction)

        def reduce_one(v):
            parts = (strategy.experimental_local_results(v)
                     if isinstance(v, tf.distribute.DistributedValues) else [v])
            if all(isinstance(x, tf.Tensor) and x.shape.rank == 0 for x in parts):
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)
        return tf.nest.map_structure(reduce_one, values)
    return reduce_per_replica


def _patched_tf_apply(original):
    """Keras 3.6-3.15's `LossScaleOptimizer._tf_apply`, where all replicas agree on "gradients finite".

    Keras checks each replica's *local* gradients and, under `merge_call`, uses
    the first local replica's answer: an inf on replica 1 only is applied, and
    under MultiWorkerMirroredStrategy a worker that skips leaves the others
    waiting in the all-reduce (FACTS.md). Here the number of replicas with
    non-finite gradients is summed over all replicas of all workers
    (`strategy.reduce(SUM)`, a float32 all-reduce through the strategy's own
    collectives) before the branch, so every replica skips the step and halves
    the loss scale together. Paths without `merge_call` keep Keras's code.
    """
    @functools.wraps(original)
    def _tf_apply(self, grads, trainable_variables=None):
        if (tf.distribute.in_cross_replica_context()
                or tf.__internal__.distribute.strategy_supports_no_merge_call()):
            return original(self, grads, trainable_variables)

        def handle_cross_replica(distribution, grads, trainable_variables):
            bad = distribution.extended.call_for_each_replica(
                lambda g: tf.cast(tf.logical_not(self.check_finite(g)), tf.float32), args=(grads,))
            finite = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, bad, axis=None), 0.0)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            tf.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            handle_cross_replica, args=(grads, trainable_variables))
    return _tf_apply


def _patched_backend_apply_gradients(original):
    """Keras 3.6-3.15's accumulating `BaseOptimizer._backend_apply_gradients` (3.6-3.9 count the step
    there too), restructured to train under a GradientFlowAllReduce (Mirrored strategies).

    Keras picks "apply" or "accumulate" with a `tf.cond` taken in replica context, and both
    branches `merge_call` (the all-reduce and the variable updates): tf.distribute refuses a
    merge_call inside a cond's graph. Here the one `merge_call` comes first; the cond is taken in
    cross-replica context on the optimizer's mirrored micro-step counter, so every replica of
    every worker takes the same branch, and each branch runs Keras's own per-replica code
    through `call_for_each_replica`, whose replica threads start inside the branch and may
    merge_call again (as `_patched_tf_apply` does). Keras's semantics are kept: a micro-step
    adds each replica's local gradients to its own accumulator, with no collective; every k-th
    micro-step, each replica takes (accumulator + g) / k, clips it, and the optimizer all-reduces
    (SUM over replicas) once, through GradientFlow: k times fewer collectives, and the CSC step
    counter and residual advance once per applied update. Other cases keep Keras's code.
    """
    @functools.wraps(original)
    def _backend_apply_gradients(self, grads, trainable_variables):
        replica_ctx = tf.distribute.get_replica_context()
        if (not self.gradient_accumulation_steps or replica_ctx is None or self.use_ema
                or tf.distribute.in_cross_replica_context()
                or not _accumulates_under_gradient_flow(replica_ctx.strategy)):
            return original(self, grads, trainable_variables)
        steps = self.gradient_accumulation_steps
        variables = list(trainable_variables)
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in variables]

        def update(grads):
            grads = self._clip_gradients([(g + a) / steps for g, a in zip(grads, accumulators)])
            self._apply_weight_decay(variables)
            self._backend_update_step(grads, variables, self.learning_rate)

        def accumulate(grads):
            self._backend_increment_gradient_accumulators(grads, accumulators)

        def in_cross_replica(distribution, grads):
            def apply_update():
                distribution.extended.call_for_each_replica(update, args=(grads,))
                self._backend_reset_gradient_accumulators()   # every replica's, after update read them

            tf.cond((self._iterations + 1) % steps == 0, apply_update,
                    lambda: distribution.extended.call_for_each_replica(accumulate, args=(grads,)))

        replica_ctx.merge_call(in_cross_replica, args=(list(grads),))
        if keras3_minor() < (3, 10):
            self._iterations.assign_add(1)   # Keras 3.6-3.9 count the micro-step here (3.10 on: in apply)
    return _backend_apply_gradients


def _patched_build(original):
    """After Keras's build, the optimizer gets its gf_tf.keras.checkpoint state under GradientFlow.

    Every optimizer's `build` reaches `TFOptimizer.build` through `super().build`.
    BackupAndRestore builds the optimizer before it loads, so the state's
    checkpoint object exists before any restore.
    """
    @functools.wraps(original)
    def build(self, variables):
        original(self, variables)
        from gf_tf.keras import checkpoint  # pylint: disable=import-outside-toplevel
        checkpoint.attach(self, self._distribution_strategy, variables)  # pylint: disable=protected-access
    return build


def _patched_loading_failure(original):
    """load_weights' error starts with gf_tf's explanation (gf_tf.keras.checkpoint_checks)."""
    from gf_tf.keras import checkpoint_checks  # pylint: disable=import-outside-toplevel
    return functools.wraps(original)(checkpoint_checks.put_gf_tf_first(original))


_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"
_ISSUE_20585 = "keras-team/keras#20585: Keras 3 multi-worker fit"

_ACCUMULATION_PATCH = Patch(
    "keras.src.optimizers.base_optimizer", "BaseOptimizer._backend_apply_gradients", (KERAS3,),
    _patched_backend_apply_gradients,
    "gradient_accumulation_steps > 1 under a GradientFlowAllReduce: the apply-or-accumulate cond "
    "taken in cross-replica context (one merge_call before it, call_for_each_replica in each "
    "branch); accumulated local gradients are all-reduced once per applied update")

PATCHES = (
    Patch(_TRAINER, "TensorFlowTrainer._maybe_symbolic_build", (KERAS3,), _patched_symbolic_build,
          f"{_ISSUE_20585}: strategy.reduce on a batch of PerReplica; build from replica 0's batch"),
    Patch(_TRAINER, "reduce_per_replica", (KERAS3,), _patched_reduce_per_replica,
          f"{_ISSUE_20585}: scalar logs reduced with axis=0; reduce them with axis=None"),
    Patch(_TRAINER, "TensorFlowTrainer._make_function", (KERAS3,), _patched_make_function,
          "steps_per_execution > 1 under Mirrored strategies: inline the one step in the loop; "
          "gradient_accumulation_steps > 1 there: a clear ValueError", since="3.7"),
    Patch(_TRAINER, "TensorFlowTrainer.make_train_function", (KERAS3,), _patched_make_train_function,
          "Keras 3.6, no _make_function: steps_per_execution > 1 under Mirrored strategies: no step "
          "past the data; gradient_accumulation_steps > 1 there: a clear ValueError", before="3.7"),
    Patch("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer._tf_apply", (KERAS3,),
          _patched_tf_apply, "every replica of every worker skips a non-finite step together"),
    Patch(_TF_OPTIMIZER, "TFOptimizer._all_reduce_sum_gradients", (KERAS3,),
          _patched_all_reduce_sum_gradients, "the gradient hook: gf_tf.all_reduce_gradients"),
    _ACCUMULATION_PATCH,
    Patch(_TF_OPTIMIZER, "TFOptimizer.build", (KERAS3,), _patched_build,
          "CSC state in the optimizer's checkpoint (reads TFOptimizer._distribution_strategy)"),
    Patch("keras.src.saving.saving_lib", "_raise_loading_failure", (KERAS3,), _patched_loading_failure,
          "load_weights: a gf_tf checkpoint mismatch's explanation first, then Keras's summary"),
    Patch("tf_keras.src.optimizers.optimizer", "Optimizer.aggregate_gradients", (TF_KERAS,),
          _patched_tf_keras_aggregate_gradients, "the gradient hook: gf_tf.all_reduce_gradients"),
    Patch("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2._aggregate_gradients",
          (TF_KERAS,), _patched_tf_keras_aggregate_gradients,
          "the gradient hook of legacy optimizers: gf_tf.all_reduce_gradients"),
    Patch("tf_keras.src.engine.training", "Model.make_train_function", (TF_KERAS,),
          _patched_tf_keras_make_train_function,
          "steps_per_execution=1 under Mirrored strategies: no step past the data's end"),
)

OVERRIDES = (
    Override("keras.src.saving.keras_saveable", "KerasSaveable", "GradientFlowCheckpoint",
             "its base: Keras's weight saving walks the optimizer's KerasSaveable attributes"),
    Override("keras.src.saving.keras_saveable", "KerasSaveable._obj_type", "GradientFlowCheckpoint",
             "'Loss', a type saving_lib.get_attr_skipset accepts and whose skip list hides nothing"),
    Override("keras.callbacks", "BackupAndRestore._save_model", "BackupAndRestore",
             "the chief writes Keras's backup, every other worker only its CSC state"),
)
