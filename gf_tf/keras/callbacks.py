"""GradientFlowStats: the Keras callback that puts a GradientFlowAllReduce's CommStats in the `fit` logs."""

from gf_tf.keras.flavour import callback_base
from gf_tf.stats import FIGURES, CommStats


class GradientFlowStats(callback_base()):
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
    listed AFTER this callback writes them as epoch scalars. After the first
    epoch it prints, once, how each variable set travels (the planner's
    `GradientFlowAllReduce.plans()`), when given the GradientFlowAllReduce.

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
        self._plans = getattr(gradient_flow, "plans", None)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.stats.totals()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        figures = self.stats.result(since=self._epoch_start)
        for name in FIGURES:
            logs[self.prefix + name] = figures[name]
        if self._plans is not None:
            for name, plan in self._plans().items():
                print(f"gf_tf: [{name}] travels as {plan.describe()}", flush=True)
            self._plans = None
