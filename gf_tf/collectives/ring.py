"""The ring: the wrapped TensorFlow cross-device ops' own SUM all-reduce (2(N-1) hops).

Under MultiWorkerMirroredStrategy that is TF's `CollectiveAllReduce` (RING, or
NCCL on GPUs): ordering, instance keys and timeouts stay TensorFlow's.
"""

from typing import Callable, List

import tensorflow as tf

from gf_tf import tf_internal

_SUM = tf.distribute.ReduceOp.SUM


def ring_sum(cross_ops: tf.distribute.CrossDeviceOps, options
             ) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """The wrapped TF ops' SUM all-reduce, per local replica a tensor (the contract of
    `gf_tf.reducers.Communicator.all_reduce_sum`), on the merge-call path. `options`:
    CommunicationOptions, or None for the defaults."""
    options = options or tf.distribute.experimental.CommunicationOptions()

    def all_reduce(tensors):
        pr = tf_internal.per_replica(tensors)
        return tf_internal.local_values(
            cross_ops.batch_reduce_implementation(_SUM, [(pr, pr)], options)[0])
    return all_reduce


def build(context) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """The algorithm's all_reduce_sum for `context`: the caller's ring, as it is."""
    return context.ring_sum


def hops(workers: int) -> int:
    """Ring hops of one all-reduce over `workers`: 2(N-1)."""
    return 2 * (workers - 1)
