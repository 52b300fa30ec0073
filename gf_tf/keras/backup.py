"""Restoring a GradientFlow job on every worker: gf_tf's BackupAndRestore and load_weights_from_chief.

A reducer's state (CSC's residuals) is each worker's own (gf_tf.keras.checkpoint), while Keras's
and TensorFlow's multi-worker recipes write one set of files, on the chief:
- `BackupAndRestore` (preemption): the chief writes Keras's backup with its reducer state, every
  other worker its own state next to it (a side file, `save_side_file`); on restart every worker
  restores the chief's weights and epoch and its own state (`restore_side_file`).
- Under `gf_tf.keras.LocalSGD` the inner optimizer's state differs between replicas (each keeps
  its own momentum between meetings): every worker, the chief included, writes its replicas'
  own next to the backup (`gf_tf_local_sgd.worker<rank>.npz`) and restores it over the chief's.
- `load_weights_from_chief` (TF's multi-worker guide: `ModelCheckpoint` on the chief, every
  worker loads that file): the chief's weights and optimizer, the other workers' reducer state
  from zero, warned (`restore_chief_reset`).

The integer arrays of a reducer's state are its counters (CSC: the step counters), equal on
every worker: a side file from another step than the chief's backup is not used, and a reset
keeps the chief's counters (every worker keeps the same schedule); every other array is zeroed.
"""

import io
import logging
import os

import keras
import numpy as np
import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.keras import checkpoint_format
from gf_tf.keras.checkpoint import STATS_PREFIX, of
from gf_tf.keras.checkpoint_hints import HINT_PREFIX

_log = logging.getLogger(__name__)
CLEANUP_ATTEMPTS = 3


def _is_counter(key: str, value) -> bool:
    """A reducer state's counter (an integer array; not a CommStats total)."""
    return not key.startswith(STATS_PREFIX) and np.issubdtype(np.asarray(value).dtype, np.integer)


def save_side_file(checkpoint, path: str) -> None:
    """Writes `checkpoint`'s state (a GradientFlowCheckpoint, this worker's) to `path` (.npz),
    atomically."""
    _write_atomically(path, checkpoint.to_bytes())


def _write_atomically(path: str, data: bytes) -> None:
    """Writes `data` to `path`: a temporary file, then a rename (a kill leaves the old file)."""
    tmp = f"{path}.tmp"
    with tf.io.gfile.GFile(tmp, "wb") as f:
        f.write(data)
    tf.io.gfile.rename(tmp, path, overwrite=True)


def restore_side_file(checkpoint, path: str) -> None:
    """Restores this worker's state from `path`, checked against the chief's backup that the
    last restore held (`GradientFlowCheckpoint.take_chief_state`; nothing to do without one).

    A missing file, or one saved at another step than the chief's backup (other counters),
    gives a warned reset (`restore_chief_reset`).
    """
    chief = checkpoint.take_chief_state()
    if chief is None:
        return
    meta = arrays = None
    if tf.io.gfile.exists(path):
        with tf.io.gfile.GFile(path, "rb") as f:
            meta, arrays = checkpoint_format.parse(f.read())
    counters = {k: v for k, v in chief[1].items() if _is_counter(k, v)}
    if meta is None or any(k not in arrays or int(arrays[k]) != int(v) for k, v in counters.items()):
        restore_chief_reset(checkpoint, chief, f"worker {checkpoint.rank}'s backup {path} is "
                            f"{'missing next to' if meta is None else 'from another step than'}"
                            f" the chief's backup")
        return
    checkpoint.restore(meta, arrays)


def restore_chief_reset(checkpoint, chief, why: str) -> None:
    """Restores the chief's state `chief` ((meta, arrays), as `take_chief_state` gives it; None:
    nothing) on this worker, with its counters, CommStats totals and hints (every worker's are the
    chief's: the FP16 scales of the next step must agree) and every other array zero; warns
    "gf_tf: WHY: its reducer state starts from zero ...". """
    if chief is None:
        return
    _log.warning("gf_tf: %s: its reducer state (CSC: residuals and momentum) starts from zero "
                 "(step counters follow the chief's).", why)
    kept = (STATS_PREFIX, HINT_PREFIX)
    arrays = {k: (v if _is_counter(k, v) or k.startswith(kept) else np.zeros_like(v))
              for k, v in chief[1].items()}
    checkpoint.restore(dict(chief[0], worker=checkpoint.rank), arrays)


def load_weights_from_chief(model, filepath, **kwargs) -> None:
    """`model.load_weights(filepath)` of a file only the chief saved, on every worker of a job.

    TF's multi-worker guide saves with `ModelCheckpoint` on the chief and loads that file on
    every worker (Horovod: rank 0 saves, every rank loads). Weights and optimizer variables are
    the chief's, as on every worker anyway. The reducer's state (CSC: residuals and velocities)
    is each worker's own: on every other worker it starts from zero, with a warning, and its
    counters follow the chief's (the same schedule everywhere; no second warm-up). On the chief,
    or with a reducer that keeps no state, this is `model.load_weights`. To resume every
    worker's own state, use BackupAndRestore.

    Args:
      model (keras.Model): a compiled Keras model of a GradientFlow strategy; its optimizer
        is built if not yet.
      filepath (str): as for `model.load_weights`.
      **kwargs (Any): as for `model.load_weights`.

    Raises:
      CheckpointMismatchError: (a ValueError, `gf_tf.keras.checkpoint_checks`) as
        `load_weights` raises it: another worker count, replica count per worker,
        variable list, pack plan, reducer or reducer settings.
    """
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    checkpoint = of(optimizer)
    if checkpoint is None:
        model.load_weights(filepath, **kwargs)
        return
    with checkpoint.loading_chief_file():
        model.load_weights(filepath, **kwargs)
    restore_chief_reset(checkpoint, checkpoint.take_chief_state(),
                        f"worker {checkpoint.rank} loaded the chief's {filepath}")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for GradientFlow jobs of one or more workers.

    Keras 3.15's callback has no multi-worker logic: every worker would write
    the same files. Here the chief (worker 0) writes the backup as Keras does
    (`latest.weights.h5`, `training_metadata.json`; with the chief's reducer
    state), every other worker writes only its own reducer state,
    `gf_tf_state.worker<rank>.npz`, in the same `backup_dir` (which must be
    visible to every worker: one host or shared storage). On restart every
    worker restores the chief's weights, optimizer and epoch (so all resume
    identically) and its own reducer state (any reducer's: its state objects
    serialize themselves, `gf_tf.reducers.Reducer.create_states`). Arguments as for
    `keras.callbacks.BackupAndRestore`.
    """

    def _rank(self) -> int:
        """This worker's rank among the workers (0 = the one that writes Keras's backup).

        With GradientFlow, its worker list; otherwise 0 on the worker TensorFlow
        checkpoints from (`strategy.extended.should_checkpoint`), 1 elsewhere (such
        workers have no reducer state to write and only restore)."""
        strategy = self.model.distribute_strategy
        workers = getattr(tf_internal.strategy_cross_device_ops(strategy), "workers", None)
        if workers is not None:
            return workers.rank
        return 0 if strategy.extended.should_checkpoint else 1

    def _side_path(self) -> str:
        return os.path.join(self.backup_dir, f"gf_tf_state.worker{self._rank()}.npz")

    def _local_sgd_path(self) -> str:
        return os.path.join(self.backup_dir, f"gf_tf_local_sgd.worker{self._rank()}.npz")

    def _local_sgd(self):
        """The `gf_tf.keras.LocalSGD` serving this fit (listed before this callback), or None.
        By its methods: local_sgd.py needs Keras 3, this module does not."""
        ops = tf_internal.strategy_cross_device_ops(self.model.distribute_strategy)
        local = getattr(ops, "local_steps", None)
        return local if hasattr(local, "replica_state") else None

    def on_train_begin(self, logs=None):
        self._restore_backup(logs)
        local, path = self._local_sgd(), self._local_sgd_path()
        if local is not None and tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path, "rb") as f:
                why = local.restore_replica_state(dict(np.load(io.BytesIO(f.read()))))
            if why:
                _log.warning("gf_tf: worker %d's LocalSGD state %s is %s: every replica resumes "
                             "with the chief's inner optimizer state.", self._rank(), path, why)

    def _restore_backup(self, logs):
        if self._rank() == 0:
            return super().on_train_begin(logs)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        checkpoint = of(optimizer)
        if checkpoint is None:
            return super().on_train_begin(logs)
        with checkpoint.loading_chief_file():
            super().on_train_begin(logs)
        return restore_side_file(checkpoint, self._side_path())

    def _save_model(self):
        # Every worker may create backup_dir at once: Keras checks, then os.makedirs
        # (FileExistsError when another worker won the race); gfile's makedirs does not mind.
        tf.io.gfile.makedirs(self.backup_dir)
        local = self._local_sgd()
        if local is not None:
            buffer = io.BytesIO()
            np.savez(buffer, **local.replica_state())
            _write_atomically(self._local_sgd_path(), buffer.getvalue())
        if self._rank() == 0:
            return super()._save_model()
        checkpoint = of(self.model.optimizer)
        if checkpoint is not None:
            save_side_file(checkpoint, self._side_path())

    def on_train_end(self, logs=None):
        # The chief removes backup_dir while the others remove their own files in it: a file
        # may vanish under either one's walk, which is no failure (the next attempt sees it gone).
        for _ in range(CLEANUP_ATTEMPTS):
            try:
                if self._rank() == 0:
                    return super().on_train_end(logs)   # removes backup_dir
                for path in (self._side_path(), self._local_sgd_path()):
                    if self.delete_checkpoint and tf.io.gfile.exists(path):
                        tf.io.gfile.remove(path)
                return None
            except (FileNotFoundError, tf.errors.NotFoundError):
                continue
        return None
