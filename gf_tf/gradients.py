"""`gf_tf.all_reduce_gradients`: the one door through which gradients reach GradientFlow.

GradientFlow compresses gradients and nothing else. Keras's optimizers send
theirs through this function (the Keras wing, `gf_tf.keras`, routes
`optimizer.apply_gradients`, and so `model.fit`, to it); a custom training
loop that all-reduces gradients itself calls it instead of
`ReplicaContext.all_reduce`. Any other all-reduce under the same strategy is
passed to TensorFlow's collectives unchanged.
"""

from typing import List, Optional, Sequence

import tensorflow as tf

from gf_tf import tf_internal


@tf.autograph.experimental.do_not_convert   # from a user's tf.function: gf_tf runs as written
def all_reduce_gradients(gradients: Sequence[Optional[tf.Tensor]], variables: Sequence,
                         reduce_op=tf.distribute.ReduceOp.SUM,
                         options: Optional[tf.distribute.experimental.CommunicationOptions] = None
                         ) -> List[Optional[tf.Tensor]]:
    """All-reduces one replica's gradients, compressed by the strategy's GradientFlowAllReduce.

    Call it in replica context (inside `strategy.run`), in place of
    `tf.distribute.get_replica_context().all_reduce(SUM, gradients)`, in a loop
    that applies the summed gradients itself:

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x)) / global_batch_size
            grads = tape.gradient(loss, model.trainable_variables)
            grads = gf_tf.all_reduce_gradients(grads, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(learning_rate * g)
        strategy.run(step, args=(x, y))

    A Keras optimizer's `apply_gradients` / `apply` all-reduce through this
    function by themselves (the Keras wing, `gf_tf.keras`): give them un-reduced
    gradients.

    Args:
      gradients: per variable a tensor (any float dtype), `tf.IndexedSlices`, or None.
      variables: the variables of those gradients, same length and order. The
        compression state (CSC residuals, momentum, step counter) belongs to this
        variable list: keep it the same objects in the same order from step to step.
      reduce_op (tf.distribute.ReduceOp | str): `tf.distribute.ReduceOp.SUM` (as Keras)
        or `MEAN`, or "sum"/"mean".
      options: `tf.distribute.experimental.CommunicationOptions` for the collectives.

    Returns:
      The all-reduced gradients, same structure; None stays None. Under a
      strategy without GradientFlowAllReduce (or no strategy) it is exactly
      `ReplicaContext.all_reduce`.

    Raises:
      ValueError: lengths differ, or called in cross-replica context.
    """
    gradients, variables = list(gradients), list(variables)
    if len(gradients) != len(variables):
        raise ValueError(f"all_reduce_gradients: {len(gradients)} gradients but "
                         f"{len(variables)} variables; pass one variable per gradient")
    replica_ctx = tf.distribute.get_replica_context()
    if replica_ctx is None:
        raise ValueError("all_reduce_gradients must be called in replica context, e.g. inside "
                         "the function given to strategy.run")
    reduce_op = tf.distribute.ReduceOp(reduce_op.upper()) if isinstance(reduce_op, str) \
        else reduce_op
    kept = [i for i, g in enumerate(gradients) if g is not None]
    if not kept:
        return list(gradients)
    values = [gradients[i] for i in kept]
    gradient_flow = _gradient_flow_of(replica_ctx.strategy)
    if gradient_flow is None:
        reduced = replica_ctx.all_reduce(reduce_op, values, options)
    else:
        reduced = gradient_flow.all_reduce_gradients(
            replica_ctx, values, [variables[i] for i in kept], reduce_op, options)
    out = list(gradients)
    for i, r in zip(kept, reduced):
        out[i] = r
    return out


def uses_gradient_flow(strategy: tf.distribute.Strategy) -> bool:
    """True if `strategy` all-reduces through a GradientFlowAllReduce."""
    return _gradient_flow_of(strategy) is not None


def _gradient_flow_of(strategy):
    """The strategy's cross-device ops if they carry gradients the GradientFlow way
    (GradientFlowAllReduce: they have `all_reduce_gradients`), else None."""
    ops = tf_internal.strategy_cross_device_ops(strategy)
    return ops if callable(getattr(ops, "all_reduce_gradients", None)) else None
