"""CSC state in checkpoints: residuals, velocities and step counters saved with the optimizer.

Error feedback (GradientFlow arXiv 1902.06855, CSC; DGC arXiv 1712.01887 s3)
carries each worker's unsent gradient mass from step to step. Losing it on a
restart wastes that mass and the dense warm-up. This module saves it with the
model's checkpoint:

- `GradientFlowCheckpoint` is attached to every Keras optimizer built under a
  strategy whose cross-device ops are a `gf_tf.GradientFlowAllReduce`
  (the `TFOptimizer.build` patch of gf_tf.keras.patches), as the attribute `_gf_tf_checkpoint`.
  So it is part of the optimizer's checkpoint: `model.save_weights` /
  `load_weights` (Keras walks the optimizer's KerasSaveable attributes; the
  state is under `optimizer/_gf_tf_checkpoint`), `ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore` and `tf.train.Checkpoint(model=...,
  optimizer=...)` (a TF dependency of the optimizer; its write may run in a tf.function).
  `tf.saved_model.save` and `model.export` leave the state out of the SavedModel's graph.
- A restore that comes before the state exists (BackupAndRestore restores in
  `on_train_begin`, before the first step is traced) is held and applied when
  GradientFlow creates the variable set's state, after checking it matches.
- Each worker saves ITS OWN replicas' state (workers see different data, so
  residuals differ); the file records the worker's rank and the worker count.
  `gf_tf.keras.backup` restores a job on every worker from the chief's files
  (`BackupAndRestore`, `load_weights_from_chief`).

Mismatches (never silent; gf_tf.keras.checkpoint_checks, at restore time):

- CheckpointMismatchError (a ValueError): another worker count, another replica
  count per worker, another worker's file loaded by plain `load_weights` (a file
  only the chief saved: `load_weights_from_chief`), another variable list or
  pack plan (compression, bytes_per_pack), momentum correction switched on/off.
- Warned reset (residuals and velocities zero, step counters kept in step
  with the other workers): a checkpoint without CSC state for a run with CSC,
  or a worker whose own CSC backup is missing or from another step than the
  chief's backup (e.g. it was killed between the chief's save and its own).
- Warning, state ignored: CSC state in the checkpoint, no CSC in this run.

The checkpoint also holds the GradientFlowAllReduce's CommStats totals (`comm_<total>`), so
figures over all steps (models.train's summary) cover the whole run after a resume too.
"""

import io
import json
import logging
import weakref
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from gf_tf import gradients, tf_internal
from gf_tf.keras.checkpoint_checks import (
    CHIEF_RECIPE, CheckpointMismatchError, another_set_message, check as _check, check_sets,
    settings_of, signature_to_json)
from gf_tf.keras.flavour import check_keras_version

FORMAT = 1
ATTRIBUTE = "_gf_tf_checkpoint"

_log = logging.getLogger("gf_tf.checkpoint")   # the name log filters know (its deprecated alias)


class _Held:
    """Plain holder (not tracked by tf.Module): restored data not yet applied."""

    def __init__(self):
        self.meta = None            # the saved meta dict
        self.arrays = None          # {key: np.ndarray}
        self.applied = set()        # indices of meta["sets"] already applied
        self.expect_side_file = False
        self.reference = None       # (meta, arrays) of the chief, on other workers
        self.gf = None              # weak reference to the GradientFlowAllReduce
        self.variables = []         # weak references to the optimizer's trainable variables
        self.num_local = 1
        self.iterations = None      # the optimizer's step counter


def _keras_saveable_class():
    """`keras.src.saving.keras_saveable.KerasSaveable`, the base Keras's weight saving walks.

    A private Keras name, listed in gf_tf.keras.patches.OVERRIDES. RuntimeError on an untested Keras.
    """
    check_keras_version()
    from keras.src.saving.keras_saveable import KerasSaveable  # pylint: disable=import-outside-toplevel
    return KerasSaveable


class GradientFlowCheckpoint(_keras_saveable_class(), tf.Module):
    """The CSC state of one optimizer's variable sets, as a Keras and TF checkpoint dependency.

    Keras format (`save_own_variables`): "meta" (uint8 JSON: format, worker,
    num_workers, local_replicas, momentum, optimizer_iterations, settings
    (compression, bytes_per_pack), per set the positions of its variables in the
    optimizer's list, its gradient signature and its pack keys and sizes), per
    set s, pack p, local replica r: "s{s}_p{p}_step_r{r}" (int64 scalar),
    "s{s}_p{p}_residual_r{r}" and "s{s}_p{p}_velocity_r{r}" (float32 [n]),
    "s{s}_p{p}_residual_l1" (float32 scalar), and the CommStats totals
    "comm_steps" (int64), "comm_dense_bytes", ... (gf_tf.stats, scalars).
    """

    def __init__(self, gradient_flow, strategy, variables):
        super().__init__(name="gf_tf_checkpoint")
        self._self_held = _Held()
        self._self_held.gf = weakref.ref(gradient_flow)
        self._self_held.variables = [weakref.ref(v) for v in variables]
        self._self_held.num_local = len(strategy.extended.worker_devices)
        gradient_flow.state_registry.add_listener(self._on_new_state)

    # --- Keras -----------------------------------------------------------------

    def _obj_type(self):
        # One of the types Keras 3.15's saving_lib.get_attr_skipset accepts; its
        # skip list (a Loss's attributes) hides nothing of ours, and nothing of
        # ours is a KerasSaveable, so the walk stops here.
        return "Loss"

    def save_own_variables(self, store):
        meta, arrays = self.state_arrays()
        store["meta"] = _encode(meta)
        for key, value in arrays.items():
            store[key] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        if "meta" not in keys:
            self.restore(None, {})
            return
        self.restore(_decode(store["meta"]), {k: np.asarray(store[k]) for k in keys if k != "meta"})

    # --- tf.train.Checkpoint: the same content as one string tensor ------------------

    def _serialize_to_tensors(self):
        return {"csc_state": self.state_tensor()}

    def _restore_from_tensors(self, restored_tensors):
        if tf.executing_eagerly():
            self.restore_bytes(restored_tensors["csc_state"].numpy())
        elif not tf_internal.in_saved_model_trace():   # else: restores nothing (state_tensor)
            raise RuntimeError("gf_tf: CSC state cannot be restored inside a tf.function (its "
                               "checks run in Python): restore eagerly, or use model.load_weights.")
        return tf.no_op()

    def state_tensor(self) -> tf.Tensor:
        """This worker's CSC state as a tf.string scalar, built with TF ops (eager or in a tf.function).

        `tf.io.serialize_tensor` of a 1-D string tensor: the JSON meta of
        `save_own_variables` (without "optimizer_iterations"), the JSON list of
        [key, dtype] of the arrays, `tf.io.serialize_tensor` of the optimizer's
        iterations (int64 scalar), then of each array in that key order. The
        meta and keys are fixed when a tf.function traces this (so trace one
        that writes checkpoints after the first step). `tf.saved_model.save`
        traces this and `_restore_from_tensors` into the SavedModel: there the
        state is left out (meta without sets; the SavedModel does not track the
        CSC variables) and the restore does nothing, so the SavedModel loads and
        serves without gf_tf. Its checkpoint (variables/) is written eagerly,
        with the state."""
        saving_model = (not tf.executing_eagerly()) and tf_internal.in_saved_model_trace()
        meta, tensors, iterations = self._state_for_tensor(saving_model)
        with tf.device("/cpu:0"):
            keys = [[key, value.dtype.name] for key, value in tensors.items()]
            parts = [tf.constant(json.dumps(meta, sort_keys=True)), tf.constant(json.dumps(keys)),
                     tf.io.serialize_tensor(iterations)]
            parts += [tf.io.serialize_tensor(value) for value in tensors.values()]
            return tf.io.serialize_tensor(tf.stack(parts))

    def _state_for_tensor(self, empty: bool):
        """(meta without the iterations, {key: tensor}, iterations int64 tensor) for `state_tensor`."""
        iterations = self._self_held.iterations
        iterations = (tf.constant(-1, tf.int64) if iterations is None or empty
                      else tf.cast(tf.convert_to_tensor(iterations), tf.int64))
        sets = [] if empty else self._my_sets()
        held = None if empty or sets else self._held_state()
        if not (sets or empty or tf.executing_eagerly()) and getattr(self._gf, "sparsity", None):
            _log.warning("gf_tf: a tf.function that writes a checkpoint was traced before the first "
                         "step: it writes the CSC state as it is now, never the live one.")
        if held is not None:
            meta = {key: value for key, value in held[0].items() if key != "optimizer_iterations"}
            return meta, {key: tf.constant(value) for key, value in held[1].items()}, iterations
        tensors = {f"s{s}_{key}": value for s, (state, _) in enumerate(sets)
                   for key, value in state.to_tensors().items()}
        if not empty:
            tensors.update({f"comm_{key}": value for key, value in self._gf.stats.to_tensors().items()})
        return self._meta(sets), tensors, iterations

    def to_bytes(self) -> bytes:
        """This worker's CSC state as .npz bytes ("meta" plus the arrays of save_own_variables): eager."""
        meta, arrays = self.state_arrays()
        buffer = io.BytesIO()
        np.savez(buffer, meta=_encode(meta), **arrays)
        return buffer.getvalue()

    def restore_bytes(self, data: bytes) -> None:
        """Restores what `to_bytes` or `state_tensor` wrote (checked as `restore` checks)."""
        self.restore(*_parse(data))

    # --- what this worker holds ------------------------------------------------

    @property
    def _gf(self):
        return self._self_held.gf()

    def _worker(self):
        workers = getattr(self._gf, "workers", None)
        return (0, 1) if workers is None else (workers.rank, workers.num_workers)

    def _positions(self, state) -> Optional[List[int]]:
        """Positions of `state`'s variables in the optimizer's list, or None if not all are there."""
        index = {}
        for i, ref in enumerate(self._self_held.variables):
            variable = ref()
            if variable is not None:   # a Keras Variable; gradients come with its tf.Variable
                index[id(variable)] = index[id(getattr(variable, "value", variable))] = i
        positions = [index.get(id(v)) for v in state.owners()]
        return None if any(p is None for p in positions) else positions

    def _my_sets(self):
        return [(s, self._positions(s)) for s in self._gf.state_registry.all_states()
                if s.has_state and self._positions(s) is not None]

    def _momentum(self) -> bool:
        sparsity = getattr(self._gf, "sparsity", None)
        return bool(sparsity is not None and sparsity.momentum > 0.0)

    def state_arrays(self):
        """(meta, {key: array}) of this worker's CSC state (held data if not applied yet): eager."""
        sets = self._my_sets()
        if not sets and self._held_state() is not None:
            return self._held_state()   # restored, no step run since
        meta = dict(self._meta(sets), optimizer_iterations=self._iterations())
        arrays = {f"s{s}_{key}": value for s, (state, _) in enumerate(sets)
                  for key, value in state.to_arrays().items()}
        arrays.update({f"comm_{key}": value.numpy() for key, value in self._gf.stats.to_tensors().items()})
        return meta, arrays

    def _held_state(self):
        """(meta, arrays) restored for this worker and not applied yet (no step run since), or None."""
        held = self._self_held
        mine = held.meta is not None and held.meta["worker"] == self._worker()[0]
        return (held.meta, dict(held.arrays)) if mine else None

    def _meta(self, sets) -> dict:
        """The meta of `state_arrays` without "optimizer_iterations" (Python values only)."""
        rank, num_workers = self._worker()
        return {"format": FORMAT, "worker": rank, "num_workers": num_workers,
                "local_replicas": self._self_held.num_local, "momentum": self._momentum(),
                "settings": settings_of(self._gf),
                "sets": [{"variables": positions, "name": state.set_name,
                          "signature": signature_to_json(state.signature),
                          "packs": [[p.key, p.num_elements] for p in state.pack_specs]}
                         for state, positions in sets]}

    def _iterations(self) -> int:
        return -1 if self._self_held.iterations is None else int(self._self_held.iterations.numpy())

    # --- restore ------------------------------------------------------------------

    def restore(self, meta: Optional[dict], arrays: Dict[str, np.ndarray]) -> None:
        """Checks `meta` against this run and applies it now or when the state is created.

        Args:
          meta: the saved meta dict (see the class docstring), or None (a checkpoint
            without CSC state).
          arrays: the saved arrays by key.

        Raises:
          CheckpointMismatchError: (a ValueError) a mismatch that would give wrong
            state (`gf_tf.keras.checkpoint`), raised before anything is assigned.
        """
        held = self._self_held
        csc = getattr(self._gf, "sparsity", None) is not None
        saved_csc = meta is not None and bool(meta.get("sets"))
        if saved_csc and meta.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"gf_tf: CSC state of format {meta.get('format')!r} in the checkpoint, this gf_tf "
                f"reads format {FORMAT}")
        if saved_csc and csc:
            self._check_fits(meta)
        self._restore_comm_totals(arrays)
        if not saved_csc:
            if csc and not held.expect_side_file:
                _log.warning("gf_tf: the checkpoint holds no CSC state (saved by a run without "
                             "gf_tf CSC, or before its first step): residuals and momentum start "
                             "from zero and the warm-up runs again.")
            return
        if not csc:
            _log.warning("gf_tf: the checkpoint holds CSC state (residuals, step counters) but this "
                         "GradientFlowAllReduce has no sparsity: the state is ignored.")
            return
        if meta["worker"] != self._worker()[0]:
            held.reference = (meta, arrays)   # the chief's, on another worker: its own file follows
            return
        held.meta, held.arrays, held.applied = meta, arrays, set()
        for state in self._gf.state_registry.all_states():
            self._apply(state)

    def _check_fits(self, meta: dict) -> None:
        """Raises CheckpointMismatchError unless the saved CSC state fits this worker's run."""
        held = self._self_held
        rank, num_workers = self._worker()
        _check(meta["num_workers"] == num_workers,
               f"it was saved by a job of {meta['num_workers']} workers, this job has "
               f"{num_workers}. Residuals are per worker: resume with the same worker count")
        _check(meta["local_replicas"] == held.num_local,
               f"it was saved with {meta['local_replicas']} replicas per worker, this worker has "
               f"{held.num_local}. Resume with the same devices per worker")
        _check(meta["worker"] == rank or held.expect_side_file,
               f"it holds worker {meta['worker']}'s state and this is worker {rank}. Each worker "
               f"must load the file it saved itself (or use gf_tf.keras.backup.BackupAndRestore); "
               f"{CHIEF_RECIPE}")
        _check(bool(meta["momentum"]) == self._momentum(),
               f"momentum correction was {'on' if meta['momentum'] else 'off'} when it was saved "
               f"and is {'on' if self._momentum() else 'off'} now")
        check_sets(meta, [ref() for ref in held.variables], self._gf)

    def _restore_comm_totals(self, arrays: Dict[str, np.ndarray]) -> None:
        """Sets the CommStats totals to the checkpoint's "comm_*" arrays (none before gf_tf saved them)."""
        totals = {key[len("comm_"):]: value for key, value in arrays.items() if key.startswith("comm_")}
        if totals:
            self._gf.stats.assign_totals(totals)

    def _on_new_state(self, state) -> None:
        self._apply(state)

    def _apply(self, state) -> None:
        held = self._self_held
        positions = self._positions(state)
        if held.meta is None or positions is None or not state.has_state:
            return
        match = [s for s, saved in enumerate(held.meta["sets"]) if saved["variables"] == positions]
        if not match:
            raise CheckpointMismatchError(another_set_message(held.meta["sets"], state.set_name,
                                                              positions))
        s = match[0]
        packs = [[p.key, p.num_elements] for p in state.pack_specs]
        _check(held.meta["sets"][s]["packs"] == packs,
               f"its pack plan {held.meta['sets'][s]['packs']} differs from this run's {packs} "
               f"(another bytes_per_pack, compression or model). Use the same settings")
        prefix = f"s{s}_"
        state.assign_arrays({key[len(prefix):]: value for key, value in held.arrays.items()
                             if key.startswith(prefix)})
        held.applied.add(s)
        if len(held.applied) == len(held.meta["sets"]):
            held.meta = held.arrays = None

    # --- a worker's own file next to the chief's backup -----------------------------

    def save_side_file(self, path: str) -> None:
        """Writes this worker's CSC state to `path` (.npz), atomically (write, then rename)."""
        tmp = f"{path}.tmp"
        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(self.to_bytes())
        tf.io.gfile.rename(tmp, path, overwrite=True)

    def restore_side_file(self, path: str) -> None:
        """Restores this worker's state from `path`, checked against the chief's backup.

        A missing file, or one saved at another step than the chief's backup,
        gives a warned reset: zero residuals and velocities, the chief's step
        counters (so every worker keeps the same schedule).
        """
        held = self._self_held
        held.expect_side_file = False
        if held.reference is None:
            return
        meta = arrays = None
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path, "rb") as f:
                meta, arrays = _parse(f.read())
        steps = {k: v for k, v in held.reference[1].items() if "_step_" in k}
        if meta is None or any(k not in arrays or int(arrays[k]) != int(v) for k, v in steps.items()):
            self.restore_chief_reset(f"worker {self._worker()[0]}'s CSC backup {path} is "
                                     f"{'missing next to' if meta is None else 'from another step than'}"
                                     f" the chief's backup")
            return
        held.reference = None
        self.restore(meta, arrays)

    def restore_chief_reset(self, why: str) -> None:
        """Restores the chief's state that the last restore held on this worker, with zero
        residuals and velocities and the chief's step counters (so every worker keeps the same
        schedule); warns "gf_tf: WHY: its residuals and momentum start from zero ...". """
        held = self._self_held
        held.expect_side_file = False
        reference, held.reference = held.reference, None
        if reference is None:
            return
        _log.warning("gf_tf: %s: its residuals and momentum start from zero (step counters follow "
                     "the chief's).", why)
        arrays = {k: (v if "_step_" in k or k.startswith("comm_") else np.zeros_like(v))
                  for k, v in reference[1].items()}
        self.restore(dict(reference[0], worker=self._worker()[0]), arrays)


def attach(optimizer, strategy, variables) -> None:
    """Gives `optimizer` its GradientFlowCheckpoint if `strategy` all-reduces through GradientFlow."""
    if not gradients.uses_gradient_flow(strategy) or hasattr(optimizer, ATTRIBUTE):
        return
    gradient_flow = tf_internal.strategy_cross_device_ops(strategy)
    with tf.init_scope():
        checkpoint = GradientFlowCheckpoint(gradient_flow, strategy, list(variables))
    checkpoint._self_held.iterations = optimizer.iterations  # pylint: disable=protected-access
    setattr(optimizer, ATTRIBUTE, checkpoint)


def of(optimizer) -> Optional[GradientFlowCheckpoint]:
    """The optimizer's GradientFlowCheckpoint (None before it is built or without GradientFlow)."""
    return getattr(optimizer, ATTRIBUTE, None)


def _encode(meta: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()


def _decode(array) -> dict:
    return json.loads(np.asarray(array, np.uint8).tobytes().decode())


def _parse(data: bytes):
    """(meta, {key: array}) of the bytes `state_tensor` wrote, or of `to_bytes`'s .npz
    (a zip: it starts with b"PK"; the format of older gf_tf checkpoints too)."""
    if data[:2] == b"PK":
        loaded = np.load(io.BytesIO(data))
        return _decode(loaded["meta"]), {k: loaded[k] for k in loaded.files if k != "meta"}
    parts = tf.io.parse_tensor(data, tf.string).numpy()
    meta, keys = json.loads(parts[0]), json.loads(parts[1])
    meta["optimizer_iterations"] = int(tf.io.parse_tensor(parts[2], tf.int64))
    arrays = {key: tf.io.parse_tensor(part, tf.as_dtype(dtype)).numpy()
              for (key, dtype), part in zip(keys, parts[3:])}
    return meta, arrays
