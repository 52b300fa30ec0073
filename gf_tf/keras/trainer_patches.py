"""The bodies of the trainer patches of gf_tf.keras.patches: multi-worker fit, the step loop.

Each `patched_*(original)` returns the wrapper that gf_tf.keras.patches.PATCHES installs in place
of `original`; the table says which Keras function each one replaces, for which Keras versions
and why. Every wrapper runs Keras's own code outside the case it fixes.
"""

import functools
import threading

import tensorflow as tf

from gf_tf import cluster
from gf_tf.collectives import deadline
from gf_tf.keras import multi_step
from gf_tf.keras.flavour import keras3_minor, keras_module
from gf_tf.keras.optimizer_patches import accumulates_under_gradient_flow

_MAKE_FUNCTION_LOCK = threading.Lock()


def in_multi_worker_mode(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy spanning more than one worker."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and cluster.of_strategy(strategy).is_multi_worker)


def replicated(strategy) -> bool:
    """True for the strategies gf_tf serves: MirroredStrategy and MultiWorkerMirroredStrategy."""
    return isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy))


def patched_symbolic_build(original):
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


def patched_reduce_per_replica(original):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not in_multi_worker_mode(strategy):
            return original(values, strategy, reduction)

        def reduce_one(v):
            parts = (strategy.experimental_local_results(v)
                     if isinstance(v, tf.distribute.DistributedValues) else [v])
            if all(isinstance(x, tf.Tensor) and x.shape.rank == 0 for x in parts):
                return mean_of_scalar_log(strategy, v, parts)
            return original(v, strategy, reduction)
        return tf.nest.map_structure(reduce_one, values)
    return reduce_per_replica


def mean_of_scalar_log(strategy, value, parts):
    """`strategy.reduce("MEAN", value, axis=None)` of a scalar log, under the step's deadline:
    the collective carries no timeout, the process's watchdog keeps it (one sleeping thread per
    timed collective would pile up at every step of every fit: gf_tf.collectives.deadline)."""
    options, step_watch = deadline.for_step(strategy)
    if step_watch is not None:
        step_watch.begin(parts)
    mean = strategy.experimental_local_results(
        strategy.extended.reduce_to(tf.distribute.ReduceOp.MEAN, value, value, options))[0]
    if step_watch is not None:
        step_watch.end(mean)
    return mean


def refuse_gradient_accumulation(model, accumulation_patch_applies) -> None:
    """Keras 3.6-3.15 all-reduce accumulated gradients inside a `cond` (merge_call there fails).

    Accumulation trains where `accumulates_under_gradient_flow`, without EMA (`use_ema=True`,
    which the accumulation patch does not cover); elsewhere a ValueError naming the fix.
    `accumulation_patch_applies`: as in `accumulates_under_gradient_flow`.
    """
    optimizer = getattr(model, "optimizer", None)
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps or steps <= 1:
        return
    gradient_flow = accumulates_under_gradient_flow(model.distribute_strategy,
                                                    accumulation_patch_applies)
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


def patched_make_function(original, accumulation_patch_applies):
    """Keras 3.7 on: the one step inlined in the multi-step loop, the one-step call guarded
    (gf_tf.keras.multi_step), gradient accumulation refused where it cannot train."""
    @functools.wraps(original)
    def _make_function(self, step_function):
        if not replicated(self.distribute_strategy):
            return original(self, step_function)
        refuse_gradient_accumulation(self, accumulation_patch_applies)
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


def patched_make_train_function(original, accumulation_patch_applies):
    """Keras 3.6 (no `_make_function`): `patched_make_function`'s refusal and guarded steps."""
    @functools.wraps(original)
    def make_train_function(self, force=False):
        if not replicated(self.distribute_strategy):
            return original(self, force=force)
        refuse_gradient_accumulation(self, accumulation_patch_applies)
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force=force)
        if not self.run_eagerly and not self.jit_compile:
            self.train_function = multi_step.guarded_function(self, self.train_step)
        return self.train_function
    return make_train_function


def patched_tf_keras_make_train_function(original):
    """tf-keras: its one-step train function, guarded (gf_tf.keras.multi_step)."""
    @functools.wraps(original)
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force=force)
        one_step = (self._steps_per_execution is None  # pylint: disable=protected-access
                    or self._steps_per_execution.numpy().item() == 1  # pylint: disable=protected-access
                    and not self.autotune_steps_per_execution)
        if (replicated(self.distribute_strategy) and one_step and not self.run_eagerly
                and not self.jit_compile and not self._cluster_coordinator):  # pylint: disable=protected-access
            self.train_function = multi_step.guarded_tf_keras_train_function(self)
            self.train_tf_function = self.train_function.tf_function
        return self.train_function
    return make_train_function
