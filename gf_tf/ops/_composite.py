"""The composite implementation of gf_tf.ops: the same contract from stock TensorFlow ops only.

It runs where the compiled kernels cannot (no library, GPU/TPU tensors, XLA) and is the
reference the kernels are tested against; gf_tf/ops/__init__.py documents each function.
"""

import tensorflow as tf

from gf_tf.ops import _checks as checks


def _round_to_odd_float32(x64):
    """float64 -> float32 rounded toward zero, last bit set if inexact.

    Casting that to float16/bfloat16 (nearest even) equals rounding the float64
    directly; a plain float64->float32->float16 cast can round twice.
    """
    f = tf.cast(x64, tf.float32)
    back = tf.cast(f, tf.float64)
    bits = tf.bitcast(f, tf.int32)
    bits = tf.where(tf.abs(back) > tf.abs(x64), bits - 1, bits)   # toward zero
    inexact = tf.logical_and(tf.not_equal(back, x64), tf.logical_not(tf.math.is_nan(x64)))
    bits = tf.where(inexact, tf.bitwise.bitwise_or(bits, 1), bits)
    return tf.bitcast(bits, tf.float32)


def _times(x, scale):
    """x * scale in x's dtype; scale: a float (1.0: nothing to do) or a float32 tensor."""
    if isinstance(scale, float):
        return x if scale == 1.0 else x * scale
    return x * tf.cast(scale, x.dtype)


def _scale_vector(scale, count, what: str, items: str) -> tf.Tensor:
    """A tensor `scale` (shape [] or [count]) as float32 [count], checked at run time."""
    rank_ok = tf.equal(tf.rank(scale), 0)
    length_ok = tf.logical_and(tf.equal(tf.rank(scale), 1),
                               tf.equal(tf.size(scale, out_type=tf.int64), tf.cast(count, tf.int64)))
    expected = count if isinstance(count, int) else "k"
    check = tf.debugging.Assert(tf.logical_or(rank_ok, length_ok), [
        f"{what}: scale must have shape [] or [{expected}] ({items}); the count and the shape "
        "of scale:", count, tf.shape(scale)])
    with tf.control_dependencies([check]):
        return tf.broadcast_to(tf.reshape(scale, [-1]), tf.reshape(count, [1]))


def _item_scales(scale, count: int, what: str, items: str) -> list:
    """Checks `scale` (see checks.scale); per item (tensor) i < count, its scale: a float or a
    float32 scalar tensor."""
    scale = checks.scale(scale, count, what, items)
    if isinstance(scale, float) or scale.shape.rank == 0:
        return [scale] * count
    if scale.shape.rank != 1 or scale.shape[0] is None:
        scale = _scale_vector(scale, count, what, items)
    return tf.unstack(scale, num=count) if count else []


def _to_wire(flat, wire_dtype, scale):
    """wire(flat * scale); scale: float, float32 scalar, or float32 per element."""
    if flat.dtype == tf.float64:
        x = _times(flat, scale)
        return tf.cast(x, tf.float32) if wire_dtype == tf.float32 else \
            tf.cast(_round_to_odd_float32(x), wire_dtype)
    return tf.cast(_times(tf.cast(flat, tf.float32), scale), wire_dtype)


def pack(tensors, wire_dtype, scale=1.0):
    tensors = checks.floating_tensors(tensors, "pack")
    wire_dtype = checks.wire(wire_dtype)
    scales = _item_scales(scale, len(tensors), "pack", checks.PER_TENSOR)
    if not tensors:
        return tf.zeros([0], wire_dtype)
    # Cast each tensor, then concatenate: the cheaper order (the casts read
    # the inputs once; one concat writes the small wire buffer).
    parts = [_to_wire(tf.reshape(t, [-1]), wire_dtype, s)
             for t, s in zip(tensors, scales)]
    return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]


def _from_wire(part, dtype, scale):
    return tf.cast(_times(tf.cast(part, tf.float32), scale), dtype)


def unpack(buffer, shapes, dtypes, scale=1.0):
    buffer, shapes, dtypes, sizes = checks.unpack_arguments(buffer, shapes, dtypes)
    scales = _item_scales(scale, len(sizes), "unpack", checks.PER_OUTPUT)
    if not sizes:
        return []
    # Split first (it returns views), then cast each part.
    parts = tf.split(buffer, sizes) if len(sizes) > 1 else [buffer]
    return [tf.reshape(_from_wire(p, d, k), s)
            for p, s, d, k in zip(parts, shapes, dtypes, scales)]


_SIGN_CLEARED = {  # dtype -> (integer dtype of its bits, mask clearing the sign bit)
    tf.float16: (tf.int16, 0x7fff), tf.bfloat16: (tf.int16, 0x7fff),
    tf.float32: (tf.int32, 0x7fffffff), tf.float64: (tf.int64, 0x7fffffffffffffff)}


def _abs_max_one(t) -> tf.Tensor:
    """max |t| as in the kernel: on the bits with the sign cleared, whose integer
    order is the order of magnitudes with NaN above inf. Exact for subnormals,
    which TensorFlow's float max reads as 0 (its kernels run denormals-are-zero)."""
    int_dtype, mask = _SIGN_CLEARED[t.dtype]
    bits = tf.bitwise.bitwise_and(tf.bitcast(tf.reshape(t, [-1]), int_dtype),
                                  tf.constant(mask, int_dtype))
    largest = tf.maximum(tf.reduce_max(bits), tf.zeros([], int_dtype))  # 0 (+0.0) if empty
    return tf.cast(tf.bitcast(largest, t.dtype), tf.float32)


def abs_max(tensors):
    tensors = checks.floating_tensors(tensors, "abs_max")
    if not tensors:
        return tf.zeros([0], tf.float32)
    return tf.stack([_abs_max_one(t) for t in tensors])


def _chunk_ids(n, chunk_size):
    return tf.range(n, dtype=tf.int64) // chunk_size


def accumulate(residual, tensors, chunk_size, velocity, momentum, lookahead=False):
    checks.chunk_size(chunk_size)
    lookahead = checks.lookahead(lookahead, velocity)
    residual = checks.flat_float32(residual, "accumulate", "residual")
    grad = pack(tensors, tf.float32, 1.0)
    if residual.shape[0] is not None:
        checks.static_length(grad, residual.shape[0], "accumulate", "the packed tensors")
    new_velocity = None
    if velocity is not None:
        velocity = checks.flat_float32(velocity, "accumulate", "velocity")
        new_velocity = momentum * velocity + grad
        grad = new_velocity
    acc = residual + grad
    n = tf.shape(acc, out_type=tf.int64)[0]
    chunks = (n + chunk_size - 1) // chunk_size
    ids = _chunk_ids(n, chunk_size)
    norms = tf.math.unsorted_segment_sum(tf.abs(acc), ids, chunks)
    if not lookahead:
        return acc, norms, new_velocity
    ahead = tf.math.unsorted_segment_sum(tf.abs(acc + momentum * new_velocity), ids, chunks)
    return acc, norms, new_velocity, ahead


def _checked_indices(indices, n, chunk_size, what):
    """Asserts indices are in [0, num_chunks), ascending and unique."""
    indices = tf.cast(indices, tf.int64)
    chunks = (n + chunk_size - 1) // chunk_size
    asserts = [
        tf.debugging.assert_non_negative(indices, message=f"{what}: indices must be >= 0"),
        tf.debugging.assert_less(indices, chunks, message=(
            f"{what}: indices out of range: every index must be < num_chunks "
            f"(ceil(n / chunk_size), chunk_size={chunk_size})")),
        tf.debugging.assert_greater(indices[1:], indices[:-1], message=(
            f"{what}: indices must be sorted ascending without duplicates")),
    ]
    with tf.control_dependencies(asserts):
        return tf.identity(indices)


def _element_mask(n, chunk_size, indices):
    """bool[n], True inside the chunks `indices` (int64, validated)."""
    chunks = (n + chunk_size - 1) // chunk_size
    chunk_selected = tf.scatter_nd(tf.expand_dims(indices, 1),
                                   tf.ones_like(indices, tf.bool), [chunks])
    return tf.gather(chunk_selected, _chunk_ids(n, chunk_size))


def _chunk_scales(scale, indices, num_selected, chunk_size, what):
    """The scale of each selected element: a float or float32 scalar, else float32 [m].

    Selected chunk j holds elements [j * chunk_size, (j + 1) * chunk_size) of
    the selected buffer (only the last chunk of a pack can be partial).
    """
    if isinstance(scale, float) or scale.shape.rank == 0:
        return scale
    if scale.shape.rank != 1 or scale.shape[0] is None or indices.shape[0] is None:
        scale = _scale_vector(scale, tf.size(indices), what, checks.PER_CHUNK)
    chunk_of_element = tf.range(num_selected, dtype=tf.int64) // chunk_size
    return tf.gather(scale, chunk_of_element)


def gather_chunks(acc, indices, chunk_size, wire_dtype, scale=1.0, velocity=None):
    checks.chunk_size(chunk_size)
    acc = checks.flat_float32(acc, "gather_chunks", "acc")
    wire_dtype = checks.wire(wire_dtype)
    indices = checks.indices(indices)
    scale = checks.scale(scale, checks.static_count(indices), "gather_chunks", checks.PER_CHUNK)
    n = tf.shape(acc, out_type=tf.int64)[0]
    checked = _checked_indices(indices, n, chunk_size, "gather_chunks")
    mask = _element_mask(n, chunk_size, checked)
    values = tf.boolean_mask(acc, mask)
    scales = _chunk_scales(scale, indices, tf.size(values, out_type=tf.int64),
                           chunk_size, "gather_chunks")
    selected = _to_wire(values, wire_dtype, scales)
    zeros = tf.zeros_like(acc)
    residual = tf.where(mask, zeros, acc)
    new_velocity = None
    if velocity is not None:
        velocity = checks.flat_float32(velocity, "gather_chunks", "velocity")
        new_velocity = tf.where(mask, zeros, velocity)
    return selected, residual, new_velocity


def scatter_chunks(selected, indices, chunk_size, shapes, dtypes, scale=1.0):
    checks.chunk_size(chunk_size)
    shapes, dtypes, sizes = checks.shapes_and_sizes(shapes, dtypes, "scatter_chunks")
    n = sum(sizes)
    selected = tf.convert_to_tensor(selected)
    indices = checks.indices(indices)
    scale = checks.scale(scale, checks.static_count(indices), "scatter_chunks", checks.PER_CHUNK)
    checked = _checked_indices(indices, tf.constant(n, tf.int64), chunk_size, "scatter_chunks")
    mask = _element_mask(n, chunk_size, checked)
    positions = tf.where(mask)
    check = tf.debugging.assert_equal(
        tf.shape(selected, out_type=tf.int64)[0], tf.shape(positions, out_type=tf.int64)[0],
        message="scatter_chunks: selected must have as many elements as the chunks in indices cover")
    with tf.control_dependencies([check]):
        scales = _chunk_scales(scale, indices, tf.shape(positions, out_type=tf.int64)[0],
                               chunk_size, "scatter_chunks")
        values = _times(tf.cast(selected, tf.float32), scales)
        # An update, not scatter_nd's sum into zeros, which would turn -0.0 into +0.0.
        full = tf.tensor_scatter_nd_update(tf.zeros([n], tf.float32), positions, values)
    return unpack(full, shapes, dtypes, 1.0)


def lowrank_project(grad, residual, q):
    grad, residual, q = checks.lowrank_factors("lowrank_project", grad, ("residual", residual),
                                               ("q", q), grad=True)
    matrix = tf.cast(grad, tf.float32) + residual
    # Column sums of squares as a product with a row of ones: TensorFlow's CPU Sum over the
    # outer axis of a row-major matrix takes about three times as long.
    squares = tf.matmul(tf.ones([1, tf.shape(matrix)[0]]), tf.square(matrix))
    bound = tf.sqrt(tf.reduce_max(tf.concat([[0.0], tf.reshape(squares, [-1])], 0)))
    return matrix, matrix @ q, bound


def lowrank_project_back(matrix, p):
    matrix, p = checks.lowrank_factors("lowrank_project_back", matrix, ("p", p))
    return tf.matmul(matrix, p, transpose_a=True)


def lowrank_reconstruct(matrix, a, b, c, d, dtype):
    matrix, a, b, c, d = checks.lowrank_factors("lowrank_reconstruct", matrix, ("a", a),
                                                ("b", b), ("c", c), ("d", d))
    out, approximation = tf.unstack(tf.matmul(tf.stack([a, c]), tf.stack([b, d]),
                                              transpose_b=True))
    return tf.cast(out, dtype), matrix - approximation
