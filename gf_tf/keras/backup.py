"""Restoring a GradientFlow job on every worker: gf_tf's BackupAndRestore and load_weights_from_chief.

CSC residuals are each worker's own (gf_tf.keras.checkpoint), while Keras's and TensorFlow's
multi-worker recipes write one set of files, on the chief:
- `BackupAndRestore` (preemption): the chief writes Keras's backup with its CSC state, every
  other worker its own CSC state next to it; on restart every worker restores the chief's
  weights and epoch and its own CSC state.
- `load_weights_from_chief` (TF's multi-worker guide: `ModelCheckpoint` on the chief, every
  worker loads that file): the chief's weights and optimizer, the other workers' CSC residuals
  from zero, warned.
"""

import os

import keras
import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.keras.checkpoint import of


def load_weights_from_chief(model, filepath, **kwargs) -> None:
    """`model.load_weights(filepath)` of a file only the chief saved, on every worker of a job.

    TF's multi-worker guide saves with `ModelCheckpoint` on the chief and loads that file on
    every worker (Horovod: rank 0 saves, every rank loads). Weights and optimizer variables are
    the chief's, as on every worker anyway. CSC residuals and velocities are each worker's own:
    on every other worker they start from zero, with a warning, and its step counters follow the
    chief's (the same schedule everywhere; no second warm-up). On the chief, or without CSC,
    this is `model.load_weights`. To resume every worker's own residuals, use BackupAndRestore.

    Args:
      model (keras.Model): a compiled Keras model of a GradientFlow strategy; its optimizer
        is built if not yet.
      filepath (str): as for `model.load_weights`.
      **kwargs (Any): as for `model.load_weights`.

    Raises:
      CheckpointMismatchError: (a ValueError, `gf_tf.keras.checkpoint_checks`) as
        `load_weights` raises it: another worker count, replica count per worker,
        variable list, pack plan or momentum correction.
    """
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    checkpoint = of(optimizer)
    if checkpoint is None:
        model.load_weights(filepath, **kwargs)
        return
    checkpoint._self_held.expect_side_file = True  # pylint: disable=protected-access
    try:
        model.load_weights(filepath, **kwargs)
    finally:
        checkpoint._self_held.expect_side_file = False  # pylint: disable=protected-access
    checkpoint.restore_chief_reset(f"worker {checkpoint._worker()[0]} loaded the chief's "  # pylint: disable=protected-access
                                   f"{filepath}")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for GradientFlow jobs of one or more workers.

    Keras 3.15's callback has no multi-worker logic: every worker would write
    the same files. Here the chief (worker 0) writes the backup as Keras does
    (`latest.weights.h5`, `training_metadata.json`; with the chief's CSC
    state), every other worker writes only its own CSC state,
    `gf_tf_state.worker<rank>.npz`, in the same `backup_dir` (which must be
    visible to every worker: one host or shared storage). On restart every
    worker restores the chief's weights, optimizer and epoch (so all resume
    identically) and its own CSC state. Arguments as for
    `keras.callbacks.BackupAndRestore`.
    """

    def _rank(self) -> int:
        """This worker's rank among the workers (0 = the one that writes Keras's backup).

        With GradientFlow, its worker list; otherwise 0 on the worker TensorFlow
        checkpoints from (`strategy.extended.should_checkpoint`), 1 elsewhere (such
        workers have no CSC state to write and only restore)."""
        strategy = self.model.distribute_strategy
        workers = getattr(tf_internal.strategy_cross_device_ops(strategy), "workers", None)
        if workers is not None:
            return workers.rank
        return 0 if strategy.extended.should_checkpoint else 1

    def _side_path(self) -> str:
        return os.path.join(self.backup_dir, f"gf_tf_state.worker{self._rank()}.npz")

    def on_train_begin(self, logs=None):
        if self._rank() == 0:
            return super().on_train_begin(logs)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        checkpoint = of(optimizer)
        if checkpoint is not None:
            checkpoint._self_held.expect_side_file = True  # pylint: disable=protected-access
        super().on_train_begin(logs)
        if checkpoint is not None:
            checkpoint.restore_side_file(self._side_path())

    def _save_model(self):
        # Every worker may create backup_dir at once: Keras checks, then os.makedirs
        # (FileExistsError when another worker won the race); gfile's makedirs does not mind.
        tf.io.gfile.makedirs(self.backup_dir)
        if self._rank() == 0:
            return super()._save_model()
        checkpoint = of(self.model.optimizer)
        if checkpoint is not None:
            checkpoint.save_side_file(self._side_path())

    def on_train_end(self, logs=None):
        if self._rank() == 0:
            return super().on_train_end(logs)
        if self.delete_checkpoint and tf.io.gfile.exists(self._side_path()):
            tf.io.gfile.remove(self._side_path())
