"""The bodies of the optimizer and saving patches of gf_tf.keras.patches.

The gradient hooks (gf_tf.all_reduce_gradients under a GradientFlowAllReduce), loss scaling
that all replicas agree on, gradient accumulation under Mirrored strategies, the reducer state in
the optimizer's checkpoint and load_weights' error. Each `patched_*(original)` returns the
wrapper that gf_tf.keras.patches.PATCHES installs in place of `original`; the table says which
Keras function each one replaces, for which Keras versions and why. Every wrapper runs Keras's
own code outside the case it fixes.
"""

import functools
from typing import Callable

import tensorflow as tf

from gf_tf.keras.flavour import keras3_minor


def accumulates_under_gradient_flow(strategy, accumulation_patch_applies: Callable[[], bool]) -> bool:
    """True where `patched_backend_apply_gradients` makes accumulation train: a GradientFlowAllReduce
    carries the strategy's all-reduce and the running Keras is one that patch was tested with
    (`accumulation_patch_applies()`, the accumulation patch's Keras range in the table)."""
    from gf_tf import gradients  # pylint: disable=import-outside-toplevel
    return gradients.uses_gradient_flow(strategy) and accumulation_patch_applies()


def patched_tf_keras_aggregate_gradients(original):
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


def patched_all_reduce_sum_gradients(original):
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


def patched_tf_apply(original):
    """Keras 3.6-3.15's `LossScaleOptimizer._tf_apply`, where all replicas agree on "gradients finite".

    Keras checks each replica's *local* gradients and, under `merge_call`, uses the first local
    replica's answer: an inf on replica 1 only is applied, and under MultiWorkerMirroredStrategy
    a worker that skips leaves the others waiting in the all-reduce. Here the number of replicas
    with non-finite gradients is summed over all replicas of all workers (`strategy.reduce(SUM)`,
    a float32 all-reduce through the strategy's own collectives) before the branch, so every
    replica skips the step and halves the loss scale together. Paths without `merge_call` keep
    Keras's code.
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


def patched_backend_apply_gradients(original, accumulation_patch_applies):
    """Keras 3.6-3.15's accumulating `BaseOptimizer._backend_apply_gradients` (3.6-3.9 count the step
    there too), restructured to train under a GradientFlowAllReduce (Mirrored strategies).

    Keras picks "apply" or "accumulate" with a `tf.cond` taken in replica context, and both
    branches `merge_call` (the all-reduce and the variable updates): tf.distribute refuses a
    merge_call inside a cond's graph. Here the one `merge_call` comes first; the cond is taken in
    cross-replica context on the optimizer's mirrored micro-step counter, so every replica of
    every worker takes the same branch, and each branch runs Keras's own per-replica code
    through `call_for_each_replica`, whose replica threads start inside the branch and may
    merge_call again (as `patched_tf_apply` does). Keras's semantics are kept: a micro-step
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
                or not accumulates_under_gradient_flow(replica_ctx.strategy,
                                                       accumulation_patch_applies)):
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


def patched_build(original):
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


def patched_loading_failure(original):
    """load_weights' error starts with gf_tf's explanation (gf_tf.keras.checkpoint_checks)."""
    from gf_tf.keras import checkpoint_checks  # pylint: disable=import-outside-toplevel
    return functools.wraps(original)(checkpoint_checks.put_gf_tf_first(original))
