"""The Keras side of gf_tf: which Keras runs, its version check, and minimal version-guarded patches.

Two Keras flavours are supported (README "Supported versions"):
- Keras 3 (`keras`, 3.15): its TensorFlow trainer fails under
  `tf.distribute.MultiWorkerMirroredStrategy` (public report keras-team/keras#20585):
  1. `TensorFlowTrainer._maybe_symbolic_build` calls
     `strategy.reduce("MEAN", <tuple of PerReplica>)` on a data batch:
     "Attempt to convert a value (PerReplica:{...}) to a Tensor". The build only
     needs the batch's structure and shapes, so we hand it local replica 0's batch.
  2. `trainer.reduce_per_replica` reduces the (scalar) logs with
     `strategy.reduce("MEAN", v, axis=0)`: "Invalid reduction dimension 0 for input
     with 0 dimensions". For scalars we reduce with axis=None (the mean over
     replicas); other values keep Keras's behaviour.
  3. `steps_per_execution > 1` fails under MirroredStrategy and MultiWorkerMirroredStrategy
     ("You must feed a value for placeholder tensor 'while/.../Placeholder_1'"; stock TF
     too): the multi-step loop calls the one-step tf.function inside a `tf.cond`. We build
     the loop with that step inlined (`_TensorFlowInliningOneStep`).
  4. `gradient_accumulation_steps > 1` fails under those strategies ("`merge_call` called
     while defining a new graph"): the all-reduce sits in a `tf.cond`. We raise a clear
     ValueError at fit time instead.
  Patches 1-2 are active only for a MultiWorkerMirroredStrategy in multi-worker
  mode, 3-4 for MirroredStrategy and MultiWorkerMirroredStrategy; all delegate to Keras's
  own code otherwise (private names:
  keras.src.backend.tensorflow.trainer: TensorFlowTrainer._maybe_symbolic_build,
  TensorFlowTrainer._make_function, reduce_per_replica).
- tf-keras (`tf_keras`, Keras 2, selected by TF_USE_LEGACY_KERAS=1 as TensorFlow
  selects it for `tf.keras`), of the same minor version as TensorFlow: its multi-worker
  `fit` needs none of the Keras 3 fixes.

Gradients reach GradientFlow through one hook per flavour (`install_gradient_hook`,
installed by GradientFlowAllReduce), each calling `gf_tf.all_reduce_gradients` when the
strategy's cross-device ops are a GradientFlowAllReduce, and Keras's own code otherwise:
- Keras 3: `TFOptimizer._all_reduce_sum_gradients` (keras.src.backend.tensorflow.optimizer),
  the optimizer's one gradient all-reduce;
- tf-keras: `Optimizer.aggregate_gradients` (tf_keras.src.optimizers.optimizer) and
  `OptimizerV2._aggregate_gradients` (tf_keras.src.optimizers.legacy.optimizer_v2), which
  otherwise call `optimizer_utils.all_reduce_sum_gradients` (`all_reduce(SUM)` or
  `batch_reduce_to(SUM, grads_and_vars)`); its LossScaleOptimizers delegate to them.

Two more Keras 3 hooks: `install_checkpoint_hook` (TFOptimizer.build,
TFOptimizer._distribution_strategy, keras.src.saving.keras_saveable.KerasSaveable:
CSC state in the optimizer's checkpoint) and `install_loss_scale_agreement`
(LossScaleOptimizer._tf_apply: replicas skip non-finite steps together).

`install()` and `install_gradient_hook()` apply only what the running flavour needs, after
`check_keras_version`. These are the only private Keras attributes gf_tf touches.
"""

import functools
import importlib
import os
import threading

import tensorflow as tf

from gf_tf import cluster

TESTED_KERAS_VERSIONS = ("3.15",)                          # Keras 3
TESTED_TF_KERAS_VERSIONS = ("2.18", "2.19", "2.20", "2.21")  # tf-keras, same minor as TensorFlow
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
_MAKE_FUNCTION_LOCK = threading.Lock()


def uses_tf_keras() -> bool:
    """True if `tf.keras` is tf-keras here: TF_USE_LEGACY_KERAS is 1/true, TensorFlow's own rule."""
    return os.environ.get(LEGACY_KERAS_ENV, "") in ("1", "true", "True")


def keras_module():
    """The Keras package `tf.keras` stands for: `tf_keras` (tf-keras) or `keras` (Keras 3)."""
    return importlib.import_module("tf_keras" if uses_tf_keras() else "keras")


def flavour() -> str:
    """"tf-keras" or "keras" (Keras 3): the Keras that models built with `tf.keras` use."""
    return "tf-keras" if uses_tf_keras() else "keras"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_keras_version(version: str = None, tf_keras: bool = None) -> None:
    """Raises RuntimeError unless the running Keras flavour and version were tested with gf_tf.

    Keras 3: TESTED_KERAS_VERSIONS. tf-keras: TESTED_TF_KERAS_VERSIONS, and the same minor
    version as TensorFlow (tf-keras X.Y is built for TensorFlow X.Y).
    """
    tf_keras = uses_tf_keras() if tf_keras is None else tf_keras
    if tf_keras:
        version = version or keras_module().__version__
        if _minor(version) not in TESTED_TF_KERAS_VERSIONS or _minor(version) != _minor(tf.__version__):
            raise RuntimeError(
                f"gf_tf was tested with tf-keras {', '.join(TESTED_TF_KERAS_VERSIONS)} "
                f"(TF_USE_LEGACY_KERAS=1), each with the TensorFlow of the same minor version; found "
                f"tf-keras {version} with TensorFlow {tf.__version__}. Install "
                f"tf-keras=={_minor(tf.__version__)}.* (or unset TF_USE_LEGACY_KERAS for Keras 3).")
        return
    version = version or keras_module().__version__
    if _minor(version) not in TESTED_KERAS_VERSIONS:
        raise RuntimeError(
            f"gf_tf patches Keras's TensorFlow trainer for multi-worker fit "
            f"(keras-team/keras#20585) and was tested with Keras "
            f"{', '.join(TESTED_KERAS_VERSIONS)}.x only; found Keras {version}. "
            f"Install keras=={TESTED_KERAS_VERSIONS[-1]}.* or port gf_tf/keras_compat.py.")


def callback_base():
    """The Callback class of the running Keras flavour (GradientFlowStats derives from it)."""
    return keras_module().callbacks.Callback


def in_multi_worker_mode(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy spanning more than one worker."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and cluster.of_strategy(strategy).is_multi_worker)


def install() -> None:
    """Installs the `fit` fixes the running Keras needs, once (idempotent).

    Called by gf_tf.MultiWorkerMirroredStrategy and GradientFlowAllReduce. tf-keras needs
    none; Keras 3 models (`import keras`) may also run in a tf-keras process, so a tested
    Keras 3 is fixed there too. Raises RuntimeError on an untested Keras.
    """
    check_keras_version()
    if not uses_tf_keras() or _tested_keras3_present():
        _install_keras3_multi_worker_fixes()


def _tested_keras3_present() -> bool:
    try:
        check_keras_version(importlib.import_module("keras").__version__, tf_keras=False)
    except (ImportError, RuntimeError):
        return False
    return True


def _install_keras3_multi_worker_fixes() -> None:
    from keras.src.backend.tensorflow import trainer as tf_trainer  # pylint: disable=import-outside-toplevel
    cls = tf_trainer.TensorFlowTrainer
    if getattr(cls, "_gf_tf_patched", False):
        return
    cls._maybe_symbolic_build = _patched_symbolic_build(cls._maybe_symbolic_build)
    cls._make_function = _patched_make_function(cls._make_function)
    tf_trainer.reduce_per_replica = _patched_reduce_per_replica(tf_trainer.reduce_per_replica)
    cls._gf_tf_patched = True
    install_loss_scale_agreement()


def install_gradient_hook() -> None:
    """Routes the Keras optimizer's gradient all-reduce to gf_tf.all_reduce_gradients (idempotent).

    Only where the strategy carries a GradientFlowAllReduce; elsewhere Keras's
    own code runs unchanged. Hooks the running flavour (and a tested Keras 3 next to
    tf-keras). Raises RuntimeError on an untested Keras version.
    """
    check_keras_version()
    if uses_tf_keras():
        _install_tf_keras_gradient_hook()
    if not uses_tf_keras() or _tested_keras3_present():
        _install_keras3_gradient_hook()


def _install_keras3_gradient_hook() -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer  # pylint: disable=import-outside-toplevel
    cls = tf_optimizer.TFOptimizer
    if getattr(cls, "_gf_tf_gradient_hook", False):
        return
    cls._all_reduce_sum_gradients = _patched_all_reduce_sum_gradients(
        cls._all_reduce_sum_gradients)
    cls._gf_tf_gradient_hook = True
    install_checkpoint_hook()


def install_checkpoint_hook() -> None:
    """Attaches gf_tf.checkpoint's CSC state to each Keras optimizer built under GradientFlow (idempotent).

    Patches `TFOptimizer.build` (keras.src.backend.tensorflow.optimizer; every
    optimizer's `build` reaches it through `super().build`): after Keras's
    build, `gf_tf.checkpoint.attach(optimizer, optimizer._distribution_strategy,
    variables)`. BackupAndRestore builds the optimizer before it loads, so the
    state's checkpoint object exists before any restore. Raises RuntimeError
    on an untested Keras version.
    """
    check_keras_version()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer  # pylint: disable=import-outside-toplevel
    cls = tf_optimizer.TFOptimizer
    if getattr(cls, "_gf_tf_checkpoint_hook", False):
        return
    original = cls.build

    @functools.wraps(original)
    def build(self, variables):
        original(self, variables)
        from gf_tf import checkpoint  # pylint: disable=import-outside-toplevel
        checkpoint.attach(self, self._distribution_strategy, variables)  # pylint: disable=protected-access

    cls.build = build
    cls._gf_tf_checkpoint_hook = True


def keras_saveable_class():
    """`keras.src.saving.keras_saveable.KerasSaveable`: the base Keras's weight saving walks."""
    check_keras_version()
    from keras.src.saving.keras_saveable import KerasSaveable  # pylint: disable=import-outside-toplevel
    return KerasSaveable


def _install_tf_keras_gradient_hook() -> None:
    from tf_keras.src.optimizers import optimizer as tfk_optimizer  # pylint: disable=import-outside-toplevel
    from tf_keras.src.optimizers.legacy import optimizer_v2  # pylint: disable=import-outside-toplevel
    for cls, name in ((tfk_optimizer.Optimizer, "aggregate_gradients"),
                      (optimizer_v2.OptimizerV2, "_aggregate_gradients")):
        if not getattr(cls, "_gf_tf_gradient_hook", False):
            setattr(cls, name, _patched_tf_keras_aggregate_gradients(getattr(cls, name)))
            cls._gf_tf_gradient_hook = True


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
        for _, _, it in iterator:
            batch = next(it)
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


def _refuse_gradient_accumulation(model) -> None:
    """Keras 3.15 all-reduces accumulated gradients inside a `cond` (merge_call there fails)."""
    steps = getattr(getattr(model, "optimizer", None), "gradient_accumulation_steps", None)
    if steps and steps > 1:
        raise ValueError(
            f"gradient_accumulation_steps={steps} does not work under "
            f"{type(model.distribute_strategy).__name__} with Keras {keras_module().__version__}: "
            f"the optimizer all-reduces the accumulated gradients inside a tf.cond, where "
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
        if self.steps_per_execution <= 1 or self.run_eagerly or self.jit_compile:
            return original(self, step_function)
        from keras.src.backend.tensorflow import trainer as tf_trainer  # pylint: disable=import-outside-toplevel
        with _MAKE_FUNCTION_LOCK:
            tf_trainer.tf = _TensorFlowInliningOneStep(tf)
            try:
                return original(self, step_function)
            finally:
                tf_trainer.tf = tf
    return _make_function


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


# --- LossScaleOptimizer: every replica of every worker takes the same finite/non-finite branch ---

def install_loss_scale_agreement() -> None:
    """Patches Keras 3.15's `LossScaleOptimizer._tf_apply` so all replicas agree on "gradients finite".

    Keras checks each replica's *local* gradients and, under `merge_call`, uses
    the first local replica's answer: an inf on replica 1 only is applied, and
    under MultiWorkerMirroredStrategy a worker that skips leaves the others
    waiting in the all-reduce (FACTS.md). Here the number of replicas with
    non-finite gradients is summed over all replicas of all workers
    (`strategy.reduce(SUM)`, a float32 all-reduce through the strategy's own
    collectives) before the branch, so every replica skips the step and halves
    the loss scale together. Paths without `merge_call` keep Keras's code.
    Idempotent; RuntimeError on an untested Keras version.
    """
    check_keras_version()
    from keras.src.optimizers import loss_scale_optimizer as lso  # pylint: disable=import-outside-toplevel
    cls = lso.LossScaleOptimizer
    if getattr(cls, "_gf_tf_agreement", False):
        return
    cls._tf_apply = _patched_tf_apply(cls._tf_apply)
    cls._gf_tf_agreement = True


def _patched_tf_apply(original):
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
