"""Local steps: gradient all-reduces a GradientFlowAllReduce skips, each replica keeping its own gradient.

Local SGD (post-local SGD: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR'20)
and DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023) let every worker take steps alone between meetings. The core's half is here:
a `GradientFlowAllReduce` whose `local_steps` says a gradient list is local returns, per
replica, that replica's own gradient scaled as the all-reduce would have scaled the sum, with
no collective at all. When to step alone and how workers meet is the caller's
(`gf_tf.keras.LocalSGD`); this module imports no Keras.
"""

from typing import Callable, List, Optional, Sequence, Union

import tensorflow as tf

from gf_tf import tf_internal

MEETING = "meeting"
"""`LocalSteps.local_for`'s answer for a meeting: an ordinary all-reduce that is not a training
step (`gf_tf.stats.StepFreeStats`: its bytes join the totals, the step count stays)."""
Decision = Optional[Union[bool, str, Callable[[], tf.Tensor]]]


class LocalSteps:
    """Which gradient all-reduces of a GradientFlowAllReduce are local (a base to subclass).

    Set one as `GradientFlowAllReduce.local_steps`; `local_for` is asked once per trace of
    each gradient all-reduce, in every replica's thread.
    """

    def local_for(self, variables: Sequence) -> Decision:
        """For the gradients of `variables` (as the optimizer passes them): None (an ordinary
        all-reduce), MEETING (an ordinary all-reduce, not a training step), True (always
        local), or a callable returning a scalar bool tensor, read in cross-replica context
        at every step (True: local), the same on every worker."""
        raise NotImplementedError


def run_merged(decision: Decision, strategy, per_replica, reduce_op, stats,
               synchronous: Callable[[], list]) -> list:
    """The merge-call gradient all-reduce under a local-steps `decision` (not None).

    Args:
      decision: True, or a callable giving a scalar bool tensor (True: this step is local).
      strategy: the strategy (cross-replica context).
      per_replica: per gradient a PerReplica (or a plain tensor for one replica).
      reduce_op: SUM (Keras: each replica's gradient is 1/R of its own mean) or MEAN.
      stats: the `gf_tf.stats.CommStats` that counts a local step (0 bytes sent).
      synchronous: the ordinary all-reduce of the same gradients (`gf_tf.route.run_merged`).

    Returns:
      Per gradient a Mirrored value; on a local step replica r's component is its own
      gradient times R (SUM; R = replicas in sync) or itself (MEAN), so one replica applies
      the step that a synchronous SUM of R equal gradients would apply.
    """
    grads = [tf_internal.local_values(v) for v in per_replica]
    factor = (strategy.num_replicas_in_sync if reduce_op == tf.distribute.ReduceOp.SUM else 1)
    dense_bytes = sum(4 * (g[0].shape.num_elements() or 0) for g in grads
                      if isinstance(g[0], tf.Tensor))

    def own():
        stats.update(dense_bytes=dense_bytes, sent_bytes=0)
        return [[_scaled(g, factor) for g in per_gradient] for per_gradient in grads]

    if decision is True:
        return [tf_internal.mirrored(values) for values in own()]
    num_local = len(grads[0])

    def flat(nested: List[list]) -> list:
        return [tf.convert_to_tensor(v) for values in nested for v in values]

    def reduced():
        return flat([tf_internal.local_values(v) for v in synchronous()])

    out = tf.cond(decision(), lambda: flat(own()), reduced)
    return [tf_internal.mirrored(out[i * num_local:(i + 1) * num_local]) for i in range(len(grads))]


def _scaled(gradient, factor):
    if factor == 1:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)
