"""Communication statistics of a GradientFlowAllReduce (bytes, chunks, residual).

`CommStats` holds running totals as tf.Variables updated inside the traced
step; `GradientFlowStats`, the Keras callback that turns them into per-step
figures in the `fit` logs (hence `History` and TensorBoard), is in the Keras
wing (`gf_tf.keras.callbacks`, exported as `gf_tf.GradientFlowStats`).
"""

from typing import Dict, Optional

import tensorflow as tf


# Per-step figures reported by CommStats.result and GradientFlowStats.
FIGURES = ("dense_bytes_per_step", "sent_bytes_per_step", "compression_ratio",
           "selected_chunks_per_step", "total_chunks_per_step", "residual_norm", "density")

# CommStats's running totals: (attribute and key of `totals()`, dtype, tf.Variable name).
_TOTALS = (("steps", tf.int64, "gf_steps"),
           ("dense_bytes", tf.float64, "gf_dense_equivalent_bytes"),
           ("sent_bytes", tf.float64, "gf_sent_bytes"),
           ("selected_chunks", tf.float64, "gf_selected_chunks"),
           ("total_chunks", tf.float64, "gf_total_chunks"),
           ("residual_norm", tf.float32, "gf_residual_norm"),
           ("densities", tf.float64, "gf_densities"))


class CommStats:
    """Running totals of what one GradientFlowAllReduce sent, as tf.Variables.

    Created with the cross-device ops object (outside any strategy scope) on
    the host CPU. `update` is called once per all-reduce step from inside the
    traced step function; `totals` and `result` read them eagerly.
    Figures are those of this worker (every worker sends the same amount).
    """

    def __init__(self):
        with tf.device("/cpu:0"):
            for attribute, dtype, name in _TOTALS:
                setattr(self, attribute, tf.Variable(0, dtype=dtype, trainable=False, name=name))

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
        return {attribute: (int if dtype.is_integer else float)(getattr(self, attribute).numpy())
                for attribute, dtype, _ in _TOTALS}

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """The running totals as tensors read from their variables (eagerly, or when a
        tf.function runs), by the keys of `totals()`: what a checkpoint saves."""
        return {attribute: getattr(self, attribute).read_value() for attribute, _, _ in _TOTALS}

    def assign_totals(self, totals: Dict[str, float]) -> None:
        """Sets the running totals (eager) from `totals()` or `to_tensors()` values, e.g. the
        ones a checkpoint restores, so that figures over all steps cover the whole run.

        Raises:
          ValueError naming a key that is not a total.
        """
        unknown = sorted(set(totals) - {attribute for attribute, _, _ in _TOTALS})
        if unknown:
            raise ValueError(f"gf_tf: CommStats has no totals {unknown}")
        with tf.device("/cpu:0"):
            for attribute, dtype, _ in _TOTALS:
                if attribute in totals:
                    getattr(self, attribute).assign(tf.cast(totals[attribute], dtype))

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
