"""Sparse gradients (`tf.IndexedSlices`: an embedding table's rows of a batch) on a 16-bit wire.

TensorFlow's all-reduce of IndexedSlices is an all-gather: every worker receives every worker's
rows and indices (padded to the longest), and the rows are summed only where the optimizer
applies them. Where a set's dense gradients travel on a 16-bit wire, its float IndexedSlices
travel as float16 too, each row scaled by its own power of two (`gf_tf.wire.power_of_two_scale`
of the row's largest magnitude, so it fits below 2**15) with the exponent sent beside it as one
more float16 column. A gathered row is never summed on the wire, so every row keeps float16's
11 significant bits relative to its own largest element, whatever its magnitude and at any
worker count: nothing overflows (65504 and beyond are scaled down) and small gradients do not
flush to zero. Non-finite rows travel unscaled and stay non-finite (the loss scaler sees them).

Bytes per worker and row of d elements: 2 (d + 1) + the index (8 for int64) instead of 4 d + 8.

Source: GradientFlow (arXiv 1902.06855), "mixed-precision communication", applied per row;
TensorFlow's `CollectiveReplicaLauncher.all_reduce_indexed_slices` (the all-gather it rides on).
"""

from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

from gf_tf import wire
from gf_tf.reducers import Sent

WIRE_DTYPE = tf.float16
ENCODABLE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def encodable(value) -> bool:
    """An IndexedSlices of float32, float16 or bfloat16 rows with a known row length."""
    return (isinstance(value, tf.IndexedSlices) and value.values.dtype in ENCODABLE_DTYPES
            and value.values.shape.rank is not None and value.values.shape.rank >= 1
            and value.values.shape[1:].is_fully_defined())


def encode(value: tf.IndexedSlices) -> tf.IndexedSlices:
    """float16 [rows, d + 1]: each row (values flattened to d elements) times 2**e, then e.

    Args:
      value: an `encodable` IndexedSlices, values of shape [rows, ...] (rows may be 0).

    Returns:
      IndexedSlices with the same indices; values float16 [rows, d + 1], dense_shape
      [dense_shape[0], d + 1] (TensorFlow's gather checks the rows against it).
    """
    d = _row_length(value)
    rows = tf.reshape(tf.cast(value.values, tf.float32), [-1, d])
    scale = wire.power_of_two_scale(tf.reduce_max(tf.abs(rows), axis=1))
    exponent = tf.round(tf.math.log(scale) / np.log(2.0))   # exact: scale is 2**e, |e| <= 126
    encoded = tf.concat([tf.cast(rows * scale[:, None], WIRE_DTYPE),
                         tf.cast(exponent[:, None], WIRE_DTYPE)], axis=1)
    dense_shape = None
    if value.dense_shape is not None:
        first = tf.cast(value.dense_shape[:1], tf.int64)
        dense_shape = tf.concat([first, tf.constant([d + 1], tf.int64)], 0)
    return tf.IndexedSlices(encoded, value.indices, dense_shape)


def decode(encoded, like: tf.IndexedSlices, divide_by: int = 1) -> tf.IndexedSlices:
    """`encode`'s rows (gathered from every worker) back in `like`'s dtype and row shape, each
    divided by its 2**e and by `divide_by` (a MEAN's replica count), in float32.

    Raises:
      ValueError: `encoded` is not an IndexedSlices (the strategy's all-reduce summed the
        encoded rows into a dense tensor, which would mix their scales).
    """
    if not isinstance(encoded, tf.IndexedSlices):
        raise ValueError(f"gf_tf: the strategy's all-reduce of float16-encoded IndexedSlices "
                         f"returned a {type(encoded).__name__}, not gathered rows; pass "
                         f"compression=None to GradientFlowAllReduce to keep sparse gradients "
                         f"float32")
    d = _row_length(like)
    values = tf.cast(encoded.values, tf.float32)
    rows = values[:, :d] / tf.pow(2.0, values[:, d:]) / float(divide_by)
    shape = tf.concat([tf.shape(rows)[:1], like.values.shape[1:].as_list()], 0)
    return tf.IndexedSlices(tf.cast(tf.reshape(rows, shape), like.values.dtype), encoded.indices,
                            like.dense_shape)


def reduce_16bit(grads, indices: Sequence[int], gather_sum: Callable, mean: bool,
                 num_replicas: int, results) -> None:
    """results[r][i] for i in `indices` (encodable IndexedSlices): encoded per served replica,
    gathered by `gather_sum` (the strategy's SUM of IndexedSlices: per index, per served
    replica), decoded (MEAN: divided by `num_replicas`)."""
    if not indices:
        return
    encoded = [[encode(g[i]) for g in grads] for i in indices]
    for i, reduced in zip(indices, gather_sum(encoded)):
        for r, value in enumerate(reduced):
            results[r][i] = decode(value, grads[r][i], num_replicas if mean else 1)


def sent(values: Sequence[tf.IndexedSlices], encoded: bool) -> Sent:
    """What one replica's IndexedSlices put into the all-gather: rows and indices, float16 with
    the exponent column when `encoded`, else in their own dtype; dense_bytes is the float32
    all-gather of the same rows."""
    dense, wire_bytes = 0, 0
    for value in values:
        rows = tf.cast(tf.shape(value.indices)[0], tf.int64)
        d, index_bytes = _row_length(value), value.indices.dtype.size
        dense += rows * (4 * d + index_bytes)
        wire_bytes += rows * ((2 * (d + 1) if encoded else value.values.dtype.size * d)
                              + index_bytes)
    return Sent(dense_bytes=dense, sent_bytes=wire_bytes)


def _row_length(value: tf.IndexedSlices) -> int:
    return int(np.prod(value.values.shape[1:].as_list(), dtype=np.int64))


__all__: List[str] = ["WIRE_DTYPE", "ENCODABLE_DTYPES", "encodable", "encode", "decode",
                      "reduce_16bit", "sent"]
