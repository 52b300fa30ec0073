"""The ring: the wrapped TensorFlow cross-device ops' own SUM all-reduce (2(N-1) hops).

Under MultiWorkerMirroredStrategy that is TF's `CollectiveAllReduce` (RING, or
NCCL on GPUs): ordering, instance keys and timeouts stay TensorFlow's.
`tf_batch_sum` is the one door to it: the step (both replica paths), TF's own
all-reduce in the trial, the probe and the settings handshake all go through it,
so the trial times what the step runs.
"""

from typing import Callable, List, Optional

import tensorflow as tf

from gf_tf import tf_internal

_SUM = tf.distribute.ReduceOp.SUM

# Per value, per served replica a tensor -> per value, per served replica its SUM.
BatchSumFn = Callable[[List[List[tf.Tensor]]], List[List[tf.Tensor]]]


def tf_batch_sum(cross_ops: tf.distribute.CrossDeviceOps, options,
                 replica_id: Optional[int] = None) -> BatchSumFn:
    """TensorFlow's own SUM all-reduce of a batch of values through `cross_ops` (the wrapped
    ops): per value, per served replica a tensor in (any dtype and shape the ops take, equal
    across replicas); per value, per served replica the SUM over all replicas of all workers
    out, one batch (TF packs it into one collective per dtype). Through `batch_reduce`, the
    ops' public entry, which hands one device's values back as they are (no collective).

    Args:
      cross_ops: the wrapped TF cross-device ops.
      options: CommunicationOptions, or None for the defaults.
      replica_id: None on the merge-call path (every local replica served, in order);
        the served replica's id in its sync group on the replica-context path (one).
    """
    options = options or tf.distribute.experimental.CommunicationOptions()

    def all_reduce(values):
        if replica_id is not None:
            reduced = tf_internal.replica_all_reduce(cross_ops, _SUM, [v[0] for v in values],
                                                     replica_id, options)
            return [[r] for r in reduced]
        pairs = [(pr, pr) for pr in (tf_internal.per_replica(v) for v in values)]
        return [tf_internal.local_values(r) for r in cross_ops.batch_reduce(_SUM, pairs, options)]
    return all_reduce


def tf_sum(cross_ops: tf.distribute.CrossDeviceOps, options,
           replica_id: Optional[int] = None) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """`tf_batch_sum` of one value: per served replica a tensor in, per served replica its SUM
    out (the contract of `gf_tf.reducers.Communicator.all_reduce_sum`)."""
    batch = tf_batch_sum(cross_ops, options, replica_id)
    return lambda tensors: batch([list(tensors)])[0]


def build(context) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """The algorithm's all_reduce_sum for `context`: TF's own SUM (`context.tf_sum`), as it is."""
    return context.tf_sum


def hops(workers: int) -> int:
    """Ring hops of one all-reduce over `workers`: 2(N-1)."""
    return 2 * (workers - 1)
