"""Communication statistics of a GradientFlowAllReduce (bytes, chunks, residual, a reducer's figures).

`CommStats` holds running totals as tf.Variables updated inside the traced
step, with a total per figure a reducer declares (`gf_tf.reducers.Sent.figures`);
`GradientFlowStats`, the Keras callback that turns them into per-step
figures in the `fit` logs (hence `History` and TensorBoard), is in the Keras
wing (`gf_tf.keras.callbacks`, exported as `gf_tf.GradientFlowStats`).
"""

import re
import warnings
from typing import Dict, Optional

import tensorflow as tf

from gf_tf import tf_internal


# Per-step figures reported by CommStats.result and GradientFlowStats.
FIGURES = ("dense_bytes_per_step", "sent_bytes_per_step", "compression_ratio",
           "selected_chunks_per_step", "total_chunks_per_step", "residual_norm", "density")
"""The per-step figures of `CommStats.result` (GradientFlowStats logs them with its prefix)."""

# CommStats's running totals: (key of `totals()`, dtype of `to_tensors()`). All but the last
# are counts, kept in one float64 variable so that a step adds them with one op (exact to 2^53).
_TOTALS = (("steps", tf.int64),
           ("dense_bytes", tf.float64),
           ("sent_bytes", tf.float64),
           ("selected_chunks", tf.float64),
           ("total_chunks", tf.float64),
           ("densities", tf.float64),
           ("residual_norm", tf.float32))
_COUNTS = [key for key, _ in _TOTALS[:-1]]
FIGURE_PREFIX = "figure_"   # totals() key of a reducer's figure: "figure_<name>"
_FIGURE_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


class CommStats:
    """Running totals of what one GradientFlowAllReduce sent, as tf.Variables.

    Created with the cross-device ops object (outside any strategy scope) on
    the host CPU. `update` is called once per all-reduce step from inside the
    traced step function; `totals` and `result` read them eagerly.
    Figures are those of this worker (every worker sends the same amount).
    A reducer's own figures (`Sent.figures`) get a float64 total each when first
    given (`figures`: name -> variable).
    """

    def __init__(self):
        with tf.device("/cpu:0"):
            self.counts = tf.Variable(tf.zeros([len(_COUNTS)], tf.float64), trainable=False,
                                      name="gf_comm_counts")
            self.residual_norm = tf.Variable(0.0, trainable=False, name="gf_residual_norm")
        self.figures: Dict[str, tf.Variable] = {}

    def _figure(self, name: str) -> tf.Variable:
        """The total of the reducer's figure `name`, created (eagerly, on the host) on first use.

        Raises:
          ValueError: `name` is not lower case letters, digits and "_" (it names log keys), or
            "<name>_per_step" is one of FIGURES.
        """
        if name not in self.figures:
            if not _FIGURE_NAME.match(str(name)) or f"{name}_per_step" in FIGURES:
                raise ValueError(f"gf_tf: a reducer's figure name must be lower case letters, "
                                 f"digits and '_', starting with a letter, and not one of "
                                 f"CommStats's own figures {FIGURES}, got {name!r}")
            with tf.init_scope():   # first given inside the traced step
                self.figures[name] = tf_internal.local_variable(
                    tf.constant(0.0, tf.float64), "/cpu:0", f"gf_figure_{name}")
        return self.figures[name]

    def update(self, dense_bytes, sent_bytes, selected_chunks=0, total_chunks=0,
               residual_norm=None, density=None, figures=None, step=True):
        """Adds one step. Byte counts are per worker replica, in bytes.

        Arguments may be Python numbers or scalar tensors.

        Args:
          dense_bytes (float | tf.Tensor): what float32 dense all-reduce would have
            sent (4 bytes x elements).
          sent_bytes (float | tf.Tensor): what actually went into the collectives
            (for CSC: chunk norms, 4 bytes per chunk, plus the selected elements in
            the wire dtype).
          selected_chunks (int | tf.Tensor): CSC chunks sent (dense steps of CSC
            count all chunks as sent).
          total_chunks (int | tf.Tensor): CSC chunks existing.
          residual_norm (float | tf.Tensor | None): L1 norm (sum of |x|) of the CSC
            residual of the first local replica over all packs after this step, or
            None (kept as it is).
          density (float | tf.Tensor | None): the step's CSC density (1.0 on dense
            steps; with density="auto" the one chosen); None counts as 1.0 (a dense
            all-reduce sends everything).
          figures (dict | None): the reducer's own figures of the step by name
            (`gf_tf.reducers.Sent.figures`), each added to its total.
          step (bool): False: an all-reduce that is not a training step of its own (a meeting
            of local steps, `gf_tf.local_steps.MEETING`): its sent bytes, chunks and figures
            join the totals, while the step count, dense bytes and densities stay, so the
            per-step figures stay per training step.
        """
        added = [1, dense_bytes, sent_bytes, selected_chunks, total_chunks,
                 1.0 if density is None else density]
        if not step:
            added[0] = added[1] = added[5] = 0
        with tf.device("/cpu:0"):
            if any(isinstance(x, (tf.Tensor, tf.Variable)) for x in added):
                self.counts.assign_add(tf.stack([tf.cast(x, tf.float64) for x in added]))
            else:
                self.counts.assign_add(tf.constant(added, tf.float64))
            if residual_norm is not None:
                self.residual_norm.assign(tf.cast(residual_norm, tf.float32))
            for name, value in (figures or {}).items():
                self._figure(name).assign_add(tf.cast(value, tf.float64))

    def __getattr__(self, name):
        """The per-figure variables of earlier versions (`stats.sent_bytes`, ...), read from
        `counts`, with a DeprecationWarning naming `totals()`."""
        if name in _COUNTS:
            warnings.warn(f"CommStats.{name} is deprecated: the counts are one variable now; "
                          f"read CommStats.totals()[{name!r}]", DeprecationWarning, stacklevel=2)
            dtype = dict(_TOTALS)[name]
            return tf.cast(self.__dict__["counts"][_COUNTS.index(name)], dtype)
        raise AttributeError(f"'CommStats' object has no attribute {name!r}")

    def totals(self) -> Dict[str, float]:
        """The running totals since creation (eager): steps, bytes, chunks, last residual norm,
        sum of the steps' densities, and "figure_<name>" per reducer's figure."""
        values = dict(zip(_COUNTS, self.counts.numpy().tolist()))
        values["residual_norm"] = float(self.residual_norm.numpy())
        totals = {key: (int if dtype.is_integer else float)(values[key]) for key, dtype in _TOTALS}
        totals.update({FIGURE_PREFIX + name: float(v.numpy()) for name, v in self.figures.items()})
        return totals

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """The running totals as tensors read from their variables (eagerly, or when a
        tf.function runs), by the keys of `totals()`: what a checkpoint saves."""
        counts = self.counts.read_value()
        tensors = {key: tf.cast(counts[i], dtype) for i, (key, dtype) in enumerate(_TOTALS[:-1])}
        tensors["residual_norm"] = self.residual_norm.read_value()
        tensors.update({FIGURE_PREFIX + name: v.read_value() for name, v in self.figures.items()})
        return tensors

    def assign_totals(self, totals: Dict[str, float]) -> None:
        """Sets the running totals (eager) from `totals()` or `to_tensors()` values, e.g. the
        ones a checkpoint restores, so that figures over all steps cover the whole run.

        Raises:
          ValueError: a key of `totals` is not a total (the message names it).
        """
        unknown = sorted(key for key in set(totals) - {key for key, _ in _TOTALS}
                         if not key.startswith(FIGURE_PREFIX))
        if unknown:
            raise ValueError(f"gf_tf: CommStats has no totals {unknown}")
        counts = self.counts.numpy()
        for i, key in enumerate(_COUNTS):
            if key in totals:
                counts[i] = float(totals[key])
        with tf.device("/cpu:0"):
            self.counts.assign(counts)
            if "residual_norm" in totals:
                self.residual_norm.assign(tf.cast(totals["residual_norm"], tf.float32))
            for key, value in totals.items():
                if key.startswith(FIGURE_PREFIX):
                    self._figure(key[len(FIGURE_PREFIX):]).assign(tf.cast(value, tf.float64))

    def result(self, since: Optional[Dict[str, float]] = None) -> dict:
        """Per-step means since creation, or since an earlier `totals()` snapshot.

        Args:
          since: a `totals()` snapshot, or None (since creation).

        Returns:
          A dict with "steps" and the FIGURES: dense_bytes_per_step,
          sent_bytes_per_step (bytes), compression_ratio (dense / sent; 0 if
          nothing was sent), selected_chunks_per_step, total_chunks_per_step,
          residual_norm (the latest value, not a mean), density (the mean CSC
          density per step: with density="auto", what it chose; 1.0 when dense);
          then per reducer's figure "<name>_per_step", its mean per step.
        """
        now = self.totals()
        if since:
            now = {k: (v if k == "residual_norm" else v - since.get(k, 0.0)) for k, v in now.items()}
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
            **{f"{key[len(FIGURE_PREFIX):]}_per_step": value / steps
               for key, value in now.items() if key.startswith(FIGURE_PREFIX)},
        }


class StepFreeStats:
    """`CommStats.update` with step=False, for an all-reduce that is not a training step."""

    def __init__(self, stats: CommStats):
        self.stats = stats

    def update(self, **added) -> None:
        self.stats.update(**added, step=False)
