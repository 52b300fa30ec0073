"""Communication statistics of a GradientFlowAllReduce (bytes, chunks, residual).

`CommStats` holds running totals as tf.Variables updated inside the traced
step; `GradientFlowStats` is the Keras callback that turns them into per-step
figures in the `fit` logs (hence `History` and TensorBoard).
"""

from typing import Dict, Optional

import tensorflow as tf

from gf_tf import keras_compat

# Per-step figures reported by CommStats.result and GradientFlowStats.
FIGURES = ("dense_bytes_per_step", "sent_bytes_per_step", "compression_ratio",
           "selected_chunks_per_step", "total_chunks_per_step", "residual_norm", "density")


class CommStats:
    """Running totals of what one GradientFlowAllReduce sent, as tf.Variables.

    Created with the cross-device ops object (outside any strategy scope) on
    the host CPU. `update` is called once per all-reduce step from inside the
    traced step function; `totals` and `result` read them eagerly.
    Figures are those of this worker (every worker sends the same amount).
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
            self.densities = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                         name="gf_densities")

    def update(self, dense_bytes, sent_bytes, selected_chunks=0, total_chunks=0,
               residual_norm=None, density=None):
        """Adds one step. Byte counts are per worker replica, in bytes.

        dense_bytes: what float32 dense all-reduce would have sent (4 bytes x
        elements); sent_bytes: what actually went into the collectives (for
        CSC: chunk norms, 4 bytes per chunk, plus the selected elements in the
        wire dtype). selected_chunks / total_chunks: CSC chunks sent / existing
        (dense steps of CSC count all chunks as sent). residual_norm: L1 norm
        (sum of |x|) of the CSC residual of the first local replica over all
        packs after this step. density: the step's CSC density (1.0 on dense
        steps; with density="auto" the one chosen); None counts as 1.0 (a dense
        all-reduce sends everything). Arguments may be Python numbers or scalar
        tensors.
        """
        with tf.device("/cpu:0"):
            self.steps.assign_add(1)
            self.dense_bytes.assign_add(tf.cast(dense_bytes, tf.float64))
            self.sent_bytes.assign_add(tf.cast(sent_bytes, tf.float64))
            self.selected_chunks.assign_add(tf.cast(selected_chunks, tf.float64))
            self.total_chunks.assign_add(tf.cast(total_chunks, tf.float64))
            if residual_norm is not None:
                self.residual_norm.assign(tf.cast(residual_norm, tf.float32))
            self.densities.assign_add(tf.cast(1.0 if density is None else density, tf.float64))

    def totals(self) -> Dict[str, float]:
        """The running totals since creation (eager): steps, bytes, chunks, last residual norm,
        sum of the steps' densities."""
        return {
            "steps": int(self.steps.numpy()),
            "dense_bytes": float(self.dense_bytes.numpy()),
            "sent_bytes": float(self.sent_bytes.numpy()),
            "selected_chunks": float(self.selected_chunks.numpy()),
            "total_chunks": float(self.total_chunks.numpy()),
            "residual_norm": float(self.residual_norm.numpy()),
            "densities": float(self.densities.numpy()),
        }

    def result(self, since: Optional[Dict[str, float]] = None) -> dict:
        """Per-step means since creation, or since an earlier `totals()` snapshot.

        Returns a dict with "steps" and the FIGURES: dense_bytes_per_step,
        sent_bytes_per_step (bytes), compression_ratio (dense / sent; 0 if
        nothing was sent), selected_chunks_per_step, total_chunks_per_step,
        residual_norm (the latest value, not a mean), density (the mean CSC
        density per step: with density="auto", what it chose; 1.0 when dense).
        """
        now = self.totals()
        if since:
            now = {k: (v if k == "residual_norm" else v - since[k]) for k, v in now.items()}
        steps = max(now["steps"], 1)
        dense = now["dense_bytes"] / steps
        sent = now["sent_bytes"] / steps
        return {
            "steps": now["steps"],
            "dense_bytes_per_step": dense,
            "sent_bytes_per_step": sent,
            "compression_ratio": dense / sent if sent else 0.0,
            "selected_chunks_per_step": now["selected_chunks"] / steps,
            "total_chunks_per_step": now["total_chunks"] / steps,
            "residual_norm": now["residual_norm"],
            "density": now["densities"] / steps if now["steps"] else 0.0,
        }


class GradientFlowStats(keras_compat.callback_base()):
    """Keras callback: GradientFlow's communication figures in the `fit` logs.

    A Keras 3 callback, or a tf-keras one when TF_USE_LEGACY_KERAS=1 (the Keras `tf.keras` is).

    At the end of every epoch it adds, per all-reduce step of that epoch,
    `gf_dense_bytes_per_step` (float32 dense-equivalent bytes),
    `gf_sent_bytes_per_step` (bytes put into the collectives),
    `gf_compression_ratio`, `gf_selected_chunks_per_step`,
    `gf_total_chunks_per_step`, `gf_residual_norm` (L1 norm of the CSC
    residual at the end of the epoch) and `gf_density` (mean CSC density per
    step; with ChunkSparsity(density="auto") what it chose) to the epoch logs. `History`
    (model.fit's return value) records them; a `keras.callbacks.TensorBoard`
    listed AFTER this callback writes them as epoch scalars.

    Args:
      gradient_flow: the `gf_tf.GradientFlowAllReduce` (or its `CommStats`)
        that carries the model's gradients.
      prefix: prefix of the log keys.

    Raises:
      TypeError if `gradient_flow` has no statistics.
    """

    def __init__(self, gradient_flow, prefix: str = "gf_"):
        super().__init__()
        stats = getattr(gradient_flow, "stats", gradient_flow)
        if not isinstance(stats, CommStats):
            raise TypeError(f"GradientFlowStats needs a gf_tf.GradientFlowAllReduce or its "
                            f"CommStats, got {type(gradient_flow).__name__}")
        self.stats = stats
        self.prefix = prefix
        self._epoch_start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.stats.totals()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        figures = self.stats.result(since=self._epoch_start)
        for name in FIGURES:
            logs[self.prefix + name] = figures[name]
