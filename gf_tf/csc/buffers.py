"""Small tensor helpers of the CSC steps (`gf_tf.csc.reducer`, `gf_tf.csc.ahead`)."""

import tensorflow as tf

from gf_tf import ops


def selected_length(n, chunk_size, idx):
    """Elements in the (sorted) chunks idx of a pack of n elements: the last chunk may be partial."""
    c = ops.num_chunks(n, chunk_size)
    short = c * chunk_size - n
    has_last = tf.reduce_any(tf.equal(idx, c - 1))     # idx may be empty (selection="global")
    return tf.size(idx) * chunk_size - short * tf.cast(has_last, tf.int32)


def pad_to(buffer, length):
    """1-D `buffer` zero-padded at the end to the static `length` (>= its length)."""
    if buffer.shape[0] == length:
        return buffer
    return tf.ensure_shape(tf.pad(buffer, [[0, length - tf.shape(buffer)[0]]]), [length])


def assign_if(condition, pairs):
    """variable.assign(value) for each pair when `condition` (scalar bool) holds."""
    def assign():
        for variable, value in pairs:
            variable.assign(value)
        return tf.constant(True)
    tf.cond(condition, assign, lambda: tf.constant(False))


def chunk_l1(values: tf.Tensor, chunk_size: int) -> tf.Tensor:
    """float32 [ceil(len / chunk_size)]: the L1 norm of each chunk of the 1-D `values`
    (static length), in float32."""
    n = int(values.shape[0])
    count = ops.num_chunks(n, chunk_size)
    padded = tf.pad(tf.cast(values, tf.float32), [[0, count * chunk_size - n]])
    return tf.reduce_sum(tf.abs(tf.reshape(padded, [count, chunk_size])), axis=1)


def without_chunks(norms: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    """float32 [C] `norms` with the entries `idx` (int32 [k]) set to 0: a residual's chunk
    norms after the chunks idx of its accumulator were sent."""
    return tf.tensor_scatter_nd_update(norms, tf.reshape(idx, [-1, 1]),
                                       tf.zeros(tf.shape(idx), tf.float32))


def record_residual_l1(state, norms, idx, finite, comm) -> tf.Tensor:
    """L1 norm of the first served replica's residual after the step (its accumulator's
    chunk `norms` without the sent chunks `idx`), kept as it was if not `finite`; stored in
    `state.residual_l1` by local replica 0."""
    with tf.device("/cpu:0"):
        residual_l1 = tf.where(finite, tf.reduce_sum(without_chunks(norms, idx)),
                               state.residual_l1.read_value())
        if comm.replicas[0] == 0:
            state.residual_l1.assign(residual_l1)
    return residual_l1
