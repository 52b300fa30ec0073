"""GradientFlow tensor ops: pack/unpack and the chunk ops of CSC.

Every function here has two implementations with the same contract:
the compiled custom ops of ``ops/`` (loaded once from ``_gf_tf_ops.so``) and
an equivalent composite of stock TensorFlow ops, used where the library
cannot run (not built, a GPU device, XLA).

Terms: a *pack* (bucket) is the 1-D concatenation of several flattened
tensors; a *chunk* is a run of ``chunk_size`` consecutive pack elements
(the last chunk may be partial), so a pack of ``n`` elements has
``num_chunks(n, chunk_size) = ceil(n / chunk_size)`` chunks.
Source: GradientFlow (arXiv 1902.06855), sections on lazy all-reduce,
mixed-precision communication and coarse-grained sparse communication.
"""

import math
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf


def num_chunks(num_elements: int, chunk_size: int) -> int:
    """ceil(num_elements / chunk_size); raises ValueError if chunk_size < 1."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 element, got {chunk_size}")
    return -(-num_elements // chunk_size)


def chunk_lengths_total(num_elements: int, chunk_size: int, indices: Sequence[int]) -> int:
    """Number of elements covered by the chunks `indices` (last chunk partial)."""
    last = num_chunks(num_elements, chunk_size) - 1
    tail = num_elements - last * chunk_size
    return sum(tail if i == last else chunk_size for i in indices)


# ---------------------------------------------------------------------------
# Composite reference implementations (stock TF ops only).
# ---------------------------------------------------------------------------

def _composite_pack(tensors, wire_dtype, scale):
    if not tensors:
        return tf.zeros([0], wire_dtype)
    flat = [tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors]
    buf = tf.concat(flat, axis=0) if len(flat) > 1 else flat[0]
    if scale != 1.0:
        buf = buf * scale
    return tf.cast(buf, wire_dtype)


def _composite_unpack(buffer, shapes, dtypes, scale):
    sizes = [int(tf.TensorShape(s).num_elements()) for s in shapes]
    buf = tf.cast(buffer, tf.float32)
    if scale != 1.0:
        buf = buf * scale
    parts = tf.split(buf, sizes) if sizes else []
    return [tf.cast(tf.reshape(p, s), d) for p, s, d in zip(parts, shapes, dtypes)]


def _chunk_ids(n, chunk_size):
    return tf.range(n, dtype=tf.int32) // chunk_size


def _composite_accumulate(residual, tensors, chunk_size, velocity, momentum):
    grad = _composite_pack(tensors, tf.float32, 1.0)
    new_velocity = None
    if velocity is not None:
        new_velocity = momentum * velocity + grad
        grad = new_velocity
    acc = residual + grad
    n = acc.shape[0]
    norms = tf.math.unsorted_segment_sum(tf.abs(acc), _chunk_ids(n, chunk_size),
                                         num_chunks(n, chunk_size))
    return acc, norms, new_velocity


def _element_mask(n, chunk_size, indices):
    """bool[n], True inside the chunks `indices`."""
    chunk_selected = tf.scatter_nd(tf.expand_dims(indices, 1),
                                   tf.ones_like(indices, tf.bool),
                                   [num_chunks(n, chunk_size)])
    return tf.gather(chunk_selected, _chunk_ids(n, chunk_size))


def _composite_gather_chunks(acc, indices, chunk_size, wire_dtype, scale, velocity):
    n = acc.shape[0]
    mask = _element_mask(n, chunk_size, indices)
    selected = tf.boolean_mask(acc, mask)
    if scale != 1.0:
        selected = selected * scale
    zeros = tf.zeros_like(acc)
    residual = tf.where(mask, zeros, acc)
    new_velocity = None if velocity is None else tf.where(mask, zeros, velocity)
    return tf.cast(selected, wire_dtype), residual, new_velocity


def _composite_scatter_chunks(selected, indices, chunk_size, shapes, dtypes, scale):
    sizes = [int(tf.TensorShape(s).num_elements()) for s in shapes]
    n = sum(sizes)
    mask = _element_mask(n, chunk_size, indices)
    positions = tf.where(mask)
    values = tf.cast(selected, tf.float32)
    full = tf.scatter_nd(positions, values, [n])
    return _composite_unpack(full, shapes, dtypes, scale)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------

def pack(tensors: Sequence[tf.Tensor], wire_dtype: tf.DType = tf.float16,
         scale: float = 1.0) -> tf.Tensor:
    """Flattens, scales and casts `tensors` into one contiguous buffer.

    Args:
      tensors: N floating tensors (float16, bfloat16, float32, float64), any
        shapes, possibly empty.
      wire_dtype: dtype of the buffer: tf.float16, tf.bfloat16 or tf.float32.
      scale: every element is multiplied by `scale` in float32 before the
        cast (prescale, e.g. 1/num_replicas). Round to nearest even; values
        beyond the wire range become +-inf; NaN stays NaN.

    Returns:
      1-D `wire_dtype` tensor of sum(size(t)) elements, in list order.
    """
    return _composite_pack(list(tensors), wire_dtype, float(scale))


def unpack(buffer: tf.Tensor, shapes: Sequence[tf.TensorShape],
           dtypes: Sequence[tf.DType], scale: float = 1.0) -> List[tf.Tensor]:
    """Inverse of `pack`: splits `buffer` into tensors of `shapes`/`dtypes`.

    Each element is cast to float32, multiplied by `scale` (postscale) and
    cast to its output dtype. Raises ValueError if the buffer's length is not
    the sum of the shapes' sizes.
    """
    return _composite_unpack(buffer, list(shapes), list(dtypes), float(scale))


def accumulate(residual: tf.Tensor, tensors: Sequence[tf.Tensor], chunk_size: int,
               velocity: Optional[tf.Tensor] = None, momentum: float = 0.0
               ) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
    """Error-feedback accumulation and chunk importance in one pass (CSC).

    g = pack(tensors, float32); with `velocity`: u = momentum * velocity + g
    (momentum correction) and g = u. acc = residual + g.

    Args:
      residual: float32 [n].
      tensors: floating tensors whose sizes sum to n.
      chunk_size: elements per chunk (>= 1).
      velocity: optional float32 [n].

    Returns:
      (acc float32 [n], norms float32 [ceil(n / chunk_size)] = per-chunk L1
      norm of acc, new velocity float32 [n] or None).
    """
    return _composite_accumulate(residual, list(tensors), int(chunk_size),
                                 velocity, float(momentum))


def gather_chunks(acc: tf.Tensor, indices: tf.Tensor, chunk_size: int,
                  wire_dtype: tf.DType = tf.float16, scale: float = 1.0,
                  velocity: Optional[tf.Tensor] = None
                  ) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
    """Gathers the chunks `indices` of `acc` into a dense wire buffer.

    Args:
      acc: float32 [n].
      indices: int32 [k], sorted ascending, unique, in [0, num_chunks).
      chunk_size: elements per chunk (>= 1).
      wire_dtype, scale: as in `pack`.
      velocity: optional float32 [n], masked like the residual.

    Returns:
      (selected `wire_dtype` [m], m = elements in those chunks; residual
      float32 [n] = acc with those chunks set to 0; velocity with those
      chunks set to 0, or None).
    """
    return _composite_gather_chunks(acc, indices, int(chunk_size), wire_dtype,
                                    float(scale), velocity)


def scatter_chunks(selected: tf.Tensor, indices: tf.Tensor, chunk_size: int,
                   shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType],
                   scale: float = 1.0) -> List[tf.Tensor]:
    """Inverse of `gather_chunks` straight into unpacked tensors.

    Positions outside the chunks `indices` are 0; inside, the `selected`
    values times `scale`, cast to each output dtype.
    """
    return _composite_scatter_chunks(selected, indices, int(chunk_size),
                                     list(shapes), list(dtypes), float(scale))
