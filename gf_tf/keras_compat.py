"""Minimal fixes Keras 3 needs for `model.fit` under MultiWorkerMirroredStrategy.

Keras 3.15's TensorFlow trainer fails under `tf.distribute.MultiWorkerMirroredStrategy`
(public report keras-team/keras#20585):
1. `TensorFlowTrainer._maybe_symbolic_build` calls
   `strategy.reduce("MEAN", <tuple of PerReplica>)` on a data batch:
   "Attempt to convert a value (PerReplica:{...}) to a Tensor". The build only
   needs the batch's structure and shapes, so we hand it local replica 0's batch.
2. `trainer.reduce_per_replica` reduces the (scalar) logs with
   `strategy.reduce("MEAN", v, axis=0)`: "Invalid reduction dimension 0 for input
   with 0 dimensions". For scalars we reduce with axis=None (the mean over
   replicas); other values keep Keras's behaviour.
3. `steps_per_execution > 1` fails deep in TF ("You must feed a value for
   placeholder tensor ... has_next"); we raise a clear ValueError instead.

Every patch is active only for a MultiWorkerMirroredStrategy in multi-worker
mode and delegates to Keras's own code otherwise.

One more hook routes gradients to GradientFlow (`install_gradient_hook`,
installed by GradientFlowAllReduce): `TFOptimizer._all_reduce_sum_gradients`
(keras.src.backend.tensorflow.optimizer), the optimizer's one gradient
all-reduce, calls `gf_tf.all_reduce_gradients` when the strategy's
cross-device ops are a GradientFlowAllReduce, and Keras's own code otherwise.

These are the only private Keras attributes gf_tf touches
(keras.src.backend.tensorflow.trainer: TensorFlowTrainer._maybe_symbolic_build,
TensorFlowTrainer._make_function, reduce_per_replica;
keras.src.backend.tensorflow.optimizer: TFOptimizer._all_reduce_sum_gradients,
TFOptimizer.build, TFOptimizer._distribution_strategy (install_checkpoint_hook);
keras.src.saving.keras_saveable.KerasSaveable),
guarded by `check_keras_version`.
"""

import functools

import keras
import tensorflow as tf

TESTED_KERAS_VERSIONS = ("3.15",)


def check_keras_version(version: str = None) -> None:
    """Raises RuntimeError unless Keras is a version these patches were written and tested for."""
    version = version or keras.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_KERAS_VERSIONS:
        raise RuntimeError(
            f"gf_tf patches Keras's TensorFlow trainer for multi-worker fit "
            f"(keras-team/keras#20585) and was tested with Keras "
            f"{', '.join(TESTED_KERAS_VERSIONS)}.x only; found Keras {version}. "
            f"Install keras=={TESTED_KERAS_VERSIONS[-1]}.* or port gf_tf/keras_compat.py.")


def in_multi_worker_mode(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy spanning more than one worker."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict() if resolver else {}
    return sum(len(spec.get(job, [])) for job in ("chief", "worker")) > 1


def install() -> None:
    """Installs the patches once (idempotent). Called by gf_tf.MultiWorkerMirroredStrategy.

    Raises RuntimeError on an untested Keras version.
    """
    check_keras_version()
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
    own code runs unchanged. Raises RuntimeError on an untested Keras version.
    """
    check_keras_version()
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


def _patched_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        if self.steps_per_execution > 1 and in_multi_worker_mode(self.distribute_strategy):
            raise ValueError(
                f"steps_per_execution={self.steps_per_execution} does not work under "
                f"MultiWorkerMirroredStrategy with Keras {keras.__version__} (its multi-step loop "
                f"fails with an unfed 'has_next' placeholder); compile the model with "
                f"steps_per_execution=1.")
        return original(self, step_function)
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
