"""Communication statistics of a GradientFlowAllReduce (bytes, chunks, residual)."""

import tensorflow as tf


class CommStats:
    """Running totals of what one GradientFlowAllReduce sent, as tf.Variables.

    Created with the cross-device ops object (outside any strategy scope) on
    the host CPU. `update` is called once per all-reduce step from inside the
    traced step function; `result` reads per-step means eagerly.
    """

    def __init__(self):
        with tf.device("/cpu:0"):
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="gf_steps")
            self.dense_bytes = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                           name="gf_dense_equivalent_bytes")
            self.sent_bytes = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                          name="gf_sent_bytes")
            self.selected_chunks = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                               name="gf_selected_chunks")
            self.total_chunks = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                            name="gf_total_chunks")
            self.residual_norm = tf.Variable(0.0, dtype=tf.float32, trainable=False,
                                             name="gf_residual_norm")

    def update(self, dense_bytes, sent_bytes, selected_chunks=0, total_chunks=0,
               residual_norm=None):
        """Adds one step. Byte counts are per worker replica, in bytes.

        dense_bytes: what float32 dense all-reduce would have sent (4 bytes x
        elements); sent_bytes: what actually went into the collectives.
        Arguments may be Python numbers or scalar tensors.
        """
        with tf.device("/cpu:0"):
            self.steps.assign_add(1)
            self.dense_bytes.assign_add(tf.cast(dense_bytes, tf.float64))
            self.sent_bytes.assign_add(tf.cast(sent_bytes, tf.float64))
            self.selected_chunks.assign_add(tf.cast(selected_chunks, tf.float64))
            self.total_chunks.assign_add(tf.cast(total_chunks, tf.float64))
            if residual_norm is not None:
                self.residual_norm.assign(tf.cast(residual_norm, tf.float32))

    def result(self) -> dict:
        """Per-step means: dense/sent bytes, compression ratio, chunks; last residual norm."""
        steps = max(int(self.steps.numpy()), 1)
        dense = float(self.dense_bytes.numpy()) / steps
        sent = float(self.sent_bytes.numpy()) / steps
        return {
            "steps": int(self.steps.numpy()),
            "dense_bytes_per_step": dense,
            "sent_bytes_per_step": sent,
            "compression_ratio": dense / sent if sent else 0.0,
            "selected_chunks_per_step": float(self.selected_chunks.numpy()) / steps,
            "total_chunks_per_step": float(self.total_chunks.numpy()) / steps,
            "residual_norm": float(self.residual_norm.numpy()),
        }
