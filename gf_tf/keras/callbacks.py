"""GradientFlowStats: the Keras callback that puts a GradientFlowAllReduce's CommStats in the `fit` logs;
StepProfile: a tf.profiler trace of one training step."""

from typing import Optional

import tensorflow as tf

from gf_tf.keras.flavour import callback_base
from gf_tf.stats import FIGURES, CommStats


class StepProfile(callback_base()):
    """Keras callback: a `tf.profiler` trace of one training batch of the first epoch that reaches it.

    `tf.profiler.experimental.start(log_dir)` at the start of batch `batch`
    (counted from 0 within the epoch), `stop()` at its end: the trace (an
    `*.xplane.pb` under `log_dir/plugins/profile/<run>/`) is what TensorBoard's
    profile plugin opens (`pip install tensorboard-plugin-profile`, then
    `tensorboard --logdir log_dir`, Profile tab, trace_viewer). One batch, once:
    a profiled step is slower than the others. Keras's
    `keras.callbacks.TensorBoard(profile_batch=...)` does the same alongside its
    summaries.

    Args:
      log_dir: directory of the trace (created if missing).
      batch: the batch to trace (>= 0); skip the first (it traces the step function).

    Raises:
      ValueError: batch < 0.
    """

    def __init__(self, log_dir: str, batch: int = 1):
        super().__init__()
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"StepProfile: batch must be an integer >= 0, got {batch!r}")
        self.log_dir = str(log_dir)
        self.batch = batch
        self._active = False
        self.done = False

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch and not self.done and not self._active:
            tf.profiler.experimental.start(self.log_dir)
            self._active = True

    def on_train_batch_end(self, batch, logs=None):
        if self._active:
            tf.profiler.experimental.stop()
            self._active, self.done = False, True

    def on_train_end(self, logs=None):
        self.on_train_batch_end(self.batch)   # a fit that ended inside the batch


class GradientFlowStats(callback_base()):
    """Keras callback: GradientFlow's communication figures in the `fit` logs.

    A Keras 3 callback, or a tf-keras one when TF_USE_LEGACY_KERAS=1 (whichever Keras
    `tf.keras` is).

    At the end of every epoch it adds, per all-reduce step of that epoch,
    `gf_dense_bytes_per_step` (float32 dense-equivalent bytes),
    `gf_sent_bytes_per_step` (bytes put into the collectives),
    `gf_compression_ratio`, `gf_selected_chunks_per_step`,
    `gf_total_chunks_per_step`, `gf_residual_norm` (L1 norm of the CSC
    residual at the end of the epoch) and `gf_density` (mean CSC density per
    step; with ChunkSparsity(density="auto") what it chose), and per figure the
    reducer declares (`gf_tf.reducers.Sent.figures`) `gf_<name>_per_step`, to the
    epoch logs. `History`
    (model.fit's return value) records them; a `keras.callbacks.TensorBoard`
    listed AFTER this callback writes them as epoch scalars. After the first
    epoch it prints how each variable set travels (the planner's
    `GradientFlowAllReduce.plans()`), when given the GradientFlowAllReduce, and
    again after an epoch that changed it (e.g. a set first traced in that epoch).
    With `profile_dir` it also writes a `tf.profiler` trace of training batch
    `profile_batch` of the first epoch that reaches it (`StepProfile`): the
    collectives (`CollectiveReduceV2`) beside the backprop ops, on TensorFlow's
    inter-op threads.

    Args:
      gradient_flow (GradientFlowAllReduce | CommStats): the
        `gf_tf.GradientFlowAllReduce` (or its `CommStats`) that carries the model's
        gradients.
      prefix: prefix of the log keys.
      profile_dir: directory of the trace, or None (default: no trace).
      profile_batch: the batch to trace (>= 0, counted within the epoch; default 1,
        after the first, which traces the step function).

    Raises:
      TypeError: `gradient_flow` has no statistics (neither a GradientFlowAllReduce nor a
        CommStats).
      ValueError: profile_batch < 0.
    """

    def __init__(self, gradient_flow, prefix: str = "gf_", profile_dir: Optional[str] = None,
                 profile_batch: int = 1):
        super().__init__()
        self.profile = None if profile_dir is None else StepProfile(profile_dir, profile_batch)
        stats = getattr(gradient_flow, "stats", gradient_flow)
        if not isinstance(stats, CommStats):
            raise TypeError(f"GradientFlowStats needs a gf_tf.GradientFlowAllReduce or its "
                            f"CommStats, got {type(gradient_flow).__name__}")
        self.stats = stats
        self.prefix = prefix
        self._epoch_start = None
        self._plans = getattr(gradient_flow, "plans", None)
        self._shown = {}   # set name -> the plan description last printed

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.stats.totals()

    def on_train_batch_begin(self, batch, logs=None):
        if self.profile is not None:
            self.profile.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.profile is not None:
            self.profile.on_train_batch_end(batch, logs)

    def on_train_end(self, logs=None):
        if self.profile is not None:
            self.profile.on_train_end(logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        figures = self.stats.result(since=self._epoch_start)
        for name in [*FIGURES, *(key for key in figures if key.endswith("_per_step")
                                 and key not in FIGURES)]:
            logs[self.prefix + name] = figures[name]
        if self._plans is not None:
            for name, plan in self._plans().items():
                if plan is not None and self._shown.get(name) != plan.describe():
                    self._shown[name] = plan.describe()
                    print(f"gf_tf: [{name}] travels as {plan.describe()}", flush=True)
