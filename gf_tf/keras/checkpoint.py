"""Reducer state in checkpoints: a reducer's state (CSC: residuals, velocities, step counters) saved with the optimizer.

Error feedback (GradientFlow arXiv 1902.06855, CSC; DGC arXiv 1712.01887 s3;
PowerSGD arXiv 1905.13727) carries each worker's unsent gradient mass from step
to step. Losing it on a restart wastes that mass (and CSC's dense warm-up). This
module saves the state of any `gf_tf.reducers.Reducer` with the model's checkpoint,
as the reducer's state objects serialize themselves (`to_arrays`, `to_tensors`,
`assign_arrays`, gathered per variable set by `gf_tf.state.VariableSetState`):

- `GradientFlowCheckpoint` is attached to every Keras optimizer built under a
  strategy whose cross-device ops are a `gf_tf.GradientFlowAllReduce`
  (the `TFOptimizer.build` patch of gf_tf.keras.patches), as the attribute `_gf_tf_checkpoint`.
  So it is part of the optimizer's checkpoint: `model.save_weights` /
  `load_weights` (Keras walks the optimizer's KerasSaveable attributes; the
  state is under `optimizer/_gf_tf_checkpoint`), `ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore` and `tf.train.Checkpoint(model=...,
  optimizer=...)` (a TF dependency of the optimizer; its write may run in a tf.function).
  `tf.saved_model.save` and `model.export` leave the state out of the SavedModel's graph.
- A restore that comes before the state exists (BackupAndRestore restores in `on_train_begin`,
  before the first step) is held and applied, once checked, when the set's state is created.
- Each worker saves ITS OWN replicas' state (workers see different data, so
  residuals differ); the file records the worker's rank and the worker count.
  `gf_tf.keras.backup` restores a job on every worker from the chief's files
  (`BackupAndRestore`, `load_weights_from_chief`). The bytes: gf_tf.keras.checkpoint_format.

Mismatches (never silent; gf_tf.keras.checkpoint_checks, at restore time):

- CheckpointMismatchError (a ValueError): another worker count, another replica
  count per worker, another worker's file loaded by plain `load_weights` (a file
  only the chief saved: `load_weights_from_chief`), another variable list or pack plan
  (compression, bytes_per_pack), another reducer class or `state_settings()`, naming both.
- Warned reset (the reducer's state from zero, its counters kept in step with the
  other workers): a checkpoint without reducer state for a run whose reducer keeps
  state, or a worker whose own backup is missing or from another step than the
  chief's backup (e.g. it was killed between the chief's save and its own).
- Warning, state ignored: reducer state in the checkpoint, a reducer without state in this run.

It also holds the CommStats totals (`comm_<total>`: a resumed run's figures cover all its steps)
and the sets' hints (`gf_tf.keras.checkpoint_hints`).
"""

import contextlib
import logging
import weakref
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from gf_tf import gradients, tf_internal
from gf_tf.keras import checkpoint_format, checkpoint_hints
from gf_tf.keras.checkpoint_checks import (
    CHIEF_RECIPE, CheckpointMismatchError, another_set_message, check as _check, check_reducer,
    check_sets, keeps_state, pack_keys_of, reducer_meta, settings_of, signature_to_json)
from gf_tf.keras.checkpoint_format import FORMAT  # noqa: F401  (its old home)
from gf_tf.keras.flavour import check_keras_version

ATTRIBUTE = "_gf_tf_checkpoint"
STATS_PREFIX = "comm_"   # the keys of the CommStats totals

_log = logging.getLogger(__name__)


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
        self.hints = {}             # restored hints (checkpoint_hints), assigned as sets appear


def _keras_saveable_class():
    """`keras.src.saving.keras_saveable.KerasSaveable`, the base Keras's weight saving walks.

    A private Keras name, listed in gf_tf.keras.patches.OVERRIDES. RuntimeError on an untested Keras.
    """
    check_keras_version()
    from keras.src.saving.keras_saveable import KerasSaveable  # pylint: disable=import-outside-toplevel
    return KerasSaveable


class GradientFlowCheckpoint(_keras_saveable_class(), tf.Module):
    """The reducer state of one optimizer's variable sets, as a Keras and TF checkpoint dependency.

    Keras format (`save_own_variables`): "meta" (uint8 JSON: format, worker, num_workers,
    local_replicas, reducer ({"class": qualified class name, "settings": [[name, number], ...]
    of its `settings()`}), optimizer_iterations, settings (compression, bytes_per_pack), per
    set its variables' positions in the optimizer's list, its signature, pack keys and sizes),
    per set s the arrays of its state (`VariableSetState.to_arrays`) under
    "s{s}_<key>" (CSC, per pack p and local replica r: "s{s}_p{p}_step_r{r}" (int64
    scalar), "s{s}_p{p}_residual_r{r}" and "s{s}_p{p}_velocity_r{r}" (float32 [n]),
    "s{s}_p{p}_residual_l1" (float32 scalar)), and the CommStats totals
    "comm_steps" (int64), "comm_dense_bytes", ... (gf_tf.stats, scalars); hints: checkpoint_hints.
    Bytes: gf_tf.keras.checkpoint_format.

    Args:
      gradient_flow (GradientFlowAllReduce): the `gf_tf.GradientFlowAllReduce` whose reducer
        state is saved.
      strategy (tf.distribute.Strategy): the strategy it all-reduces for (its local replica
        count is recorded).
      variables (Sequence[tf.Variable]): the optimizer's trainable variables, in its order.
      iterations (tf.Variable | None): the optimizer's step counter (an int64 variable), or
        None.
    """

    def __init__(self, gradient_flow, strategy, variables, iterations=None):
        super().__init__(name="gf_tf_checkpoint")
        self._self_held = _Held()
        self._self_held.gf = weakref.ref(gradient_flow)
        self._self_held.variables = [weakref.ref(v) for v in variables]
        self._self_held.num_local = len(strategy.extended.worker_devices)
        self._self_held.iterations = iterations
        gradient_flow.state_registry.add_listener(self._on_new_state)

    # --- Keras -----------------------------------------------------------------

    def _obj_type(self):
        # One of the types Keras 3.15's saving_lib.get_attr_skipset accepts; its
        # skip list (a Loss's attributes) hides nothing of ours, and nothing of
        # ours is a KerasSaveable, so the walk stops here.
        return "Loss"

    def save_own_variables(self, store):
        meta, arrays = self.state_arrays()
        store["meta"] = checkpoint_format.encode_meta(meta)
        for key, value in arrays.items():
            store[key] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        if "meta" not in keys:
            self.restore(None, {})
            return
        self.restore(checkpoint_format.decode_meta(store["meta"]),
                     {k: np.asarray(store[k]) for k in keys if k != "meta"})

    # --- tf.train.Checkpoint: the same content as one string tensor ------------------

    def _serialize_to_tensors(self):
        return {"csc_state": self.state_tensor()}

    def _restore_from_tensors(self, restored_tensors):
        if tf.executing_eagerly():
            self.restore_bytes(restored_tensors["csc_state"].numpy())
        elif not tf_internal.in_saved_model_trace():   # else: restores nothing (state_tensor)
            raise RuntimeError("gf_tf: reducer state cannot be restored inside a tf.function (its "
                               "checks run in Python): restore eagerly, or use model.load_weights.")
        return tf.no_op()

    @tf.autograph.experimental.do_not_convert   # from a user's tf.function: runs as written
    def state_tensor(self) -> tf.Tensor:
        """This worker's reducer state as a tf.string scalar, built with TF ops (eager or in a tf.function).

        `checkpoint_format.to_string_tensor` of the meta of `save_own_variables`
        (without "optimizer_iterations"), the arrays and the optimizer's iterations.
        The meta and keys are fixed when a tf.function traces this (so trace one
        that writes checkpoints after the first step). `tf.saved_model.save`
        traces this and `_restore_from_tensors` into the SavedModel: there the
        state is left out (meta without sets; the SavedModel does not track the
        reducer's variables) and the restore does nothing, so the SavedModel loads and
        serves without gf_tf. Its checkpoint (variables/) is written eagerly,
        with the state."""
        saving_model = (not tf.executing_eagerly()) and tf_internal.in_saved_model_trace()
        return checkpoint_format.to_string_tensor(*self._state_for_tensor(saving_model))

    def _state_for_tensor(self, empty: bool):
        """(meta without the iterations, {key: tensor}, iterations int64 tensor) for `state_tensor`."""
        iterations = self._self_held.iterations
        iterations = (tf.constant(-1, tf.int64) if iterations is None or empty
                      else tf.cast(tf.convert_to_tensor(iterations), tf.int64))
        sets = [] if empty else self._my_sets()
        held = None if empty or sets else self._held_state()
        if not (sets or empty or tf.executing_eagerly()) and keeps_state(self._gf.reducer):
            _log.warning("gf_tf: a tf.function that writes a checkpoint was traced before the first "
                         "step: it writes the reducer state as it is now, never the live one.")
        if held is not None:
            meta = {key: value for key, value in held[0].items() if key != "optimizer_iterations"}
            return meta, {key: tf.constant(value) for key, value in held[1].items()}, iterations
        tensors = {f"s{s}_{key}": value for s, (state, _) in enumerate(sets)
                   for key, value in state.to_tensors().items()}
        if not empty:
            tensors.update({STATS_PREFIX + key: value
                            for key, value in self._gf.stats.to_tensors().items()})
            tensors.update(self._hints(lambda v: v.read_value()))
        return self._meta(sets), tensors, iterations

    def to_bytes(self) -> bytes:
        """This worker's reducer state as .npz bytes ("meta" plus the arrays of save_own_variables): eager."""
        return checkpoint_format.to_npz(*self.state_arrays())

    def restore_bytes(self, data: bytes) -> None:
        """Restores what `to_bytes` or `state_tensor` wrote (checked as `restore` checks)."""
        self.restore(*checkpoint_format.parse(data))

    # --- what this worker holds ------------------------------------------------

    @property
    def _gf(self):
        return self._self_held.gf()

    @property
    def rank(self) -> int:
        """This worker's rank among the GradientFlowAllReduce's workers (0 with one worker)."""
        workers = getattr(self._gf, "workers", None)
        return 0 if workers is None else workers.rank

    def _num_workers(self) -> int:
        workers = getattr(self._gf, "workers", None)
        return 1 if workers is None else workers.num_workers

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

    def state_arrays(self):
        """(meta, {key: array}) of this worker's reducer state (held data if not applied yet): eager."""
        sets = self._my_sets()
        if not sets and self._held_state() is not None:
            return self._held_state()   # restored, no step run since
        meta = dict(self._meta(sets), optimizer_iterations=self._iterations())
        arrays = {f"s{s}_{key}": value for s, (state, _) in enumerate(sets)
                  for key, value in state.to_arrays().items()}
        arrays.update({STATS_PREFIX + key: value.numpy()
                       for key, value in self._gf.stats.to_tensors().items()})
        arrays.update(self._hints(lambda v: v.numpy()))
        return meta, arrays

    def _hints(self, read):
        return checkpoint_hints.hints_of(self._gf.state_registry.all_states(), self._positions, read)

    def _held_state(self):
        """(meta, arrays) restored for this worker and not applied yet (no step run since), or None."""
        held = self._self_held
        mine = held.meta is not None and held.meta["worker"] == self.rank
        return (held.meta, dict(held.arrays)) if mine else None

    def _meta(self, sets) -> dict:
        """The meta of `state_arrays` without "optimizer_iterations" (Python values only)."""
        return {"format": FORMAT, "worker": self.rank, "num_workers": self._num_workers(),
                "local_replicas": self._self_held.num_local,
                "reducer": reducer_meta(self._gf.reducer), "settings": settings_of(self._gf),
                "sets": [{"variables": positions, "name": state.set_name,
                          "signature": signature_to_json(state.signature),
                          "packs": pack_keys_of(state)}
                         for state, positions in sets]}

    def _iterations(self) -> int:
        return -1 if self._self_held.iterations is None else int(self._self_held.iterations.numpy())

    # --- restore ------------------------------------------------------------------

    def restore(self, meta: Optional[dict], arrays: Dict[str, np.ndarray]) -> None:
        """Checks `meta` against this run and applies it now or when the state is created.

        Args:
          meta: the saved meta dict (see the class docstring; format 1 is read as
            `checkpoint_format.upgrade` maps it), or None (a checkpoint without
            reducer state).
          arrays: the saved arrays by key.

        Raises:
          CheckpointMismatchError: (a ValueError) a mismatch that would give wrong
            state (`gf_tf.keras.checkpoint`), raised before anything is assigned.
        """
        held = self._self_held
        reducer = self._gf.reducer
        stateful = keeps_state(reducer)
        saved_state = meta is not None and bool(meta.get("sets"))
        if saved_state and meta.get("format") not in checkpoint_format.READS:
            raise CheckpointMismatchError(
                f"gf_tf: reducer state of format {meta.get('format')!r} in the checkpoint, this "
                f"gf_tf reads formats {checkpoint_format.READS}")
        meta = checkpoint_format.upgrade(meta) if saved_state else meta
        if saved_state and stateful:
            self._check_fits(meta)
        self._restore_comm_totals(arrays)
        held.hints = checkpoint_hints.saved(arrays)
        checkpoint_hints.assign(self._gf.state_registry.all_states(), self._positions, held.hints)
        if not saved_state:
            if stateful and not held.expect_side_file:
                _log.warning("gf_tf: the checkpoint holds no reducer state (saved by a run whose "
                             "reducer keeps none, or before its first step): the state of %s "
                             "starts from zero (CSC: residuals and momentum, and the warm-up runs "
                             "again).", reducer_meta(reducer)["class"])
            return
        if not stateful:
            _log.warning("gf_tf: the checkpoint holds the state of the reducer %s but this "
                         "GradientFlowAllReduce's reducer %s keeps none: the state is ignored.",
                         meta["reducer"]["class"], reducer_meta(reducer)["class"])
            return
        if meta["worker"] != self.rank:
            held.reference = (meta, arrays)   # the chief's, on another worker: its own file follows
            return
        held.meta, held.arrays, held.applied = meta, arrays, set()
        for state in self._gf.state_registry.all_states():
            self._apply(state)

    def _check_fits(self, meta: dict) -> None:
        """Raises CheckpointMismatchError unless the saved reducer state fits this worker's run."""
        held = self._self_held
        num_workers = self._num_workers()
        _check(meta["num_workers"] == num_workers,
               f"it was saved by a job of {meta['num_workers']} workers, this job has "
               f"{num_workers}. Residuals are per worker: resume with the same worker count")
        _check(meta["local_replicas"] == held.num_local,
               f"it was saved with {meta['local_replicas']} replicas per worker, this worker has "
               f"{held.num_local}. Resume with the same devices per worker")
        _check(meta["worker"] == self.rank or held.expect_side_file,
               f"it holds worker {meta['worker']}'s state and this is worker {self.rank}. Each worker "
               f"must load the file it saved itself (or use gf_tf.keras.backup.BackupAndRestore); "
               f"{CHIEF_RECIPE}")
        check_reducer(meta["reducer"], self._gf.reducer)
        check_sets(meta, [ref() for ref in held.variables], self._gf)

    def _restore_comm_totals(self, arrays: Dict[str, np.ndarray]) -> None:
        """Sets the CommStats totals to the checkpoint's "comm_*" arrays (none before gf_tf saved them)."""
        totals = {key[len(STATS_PREFIX):]: value for key, value in arrays.items()
                  if key.startswith(STATS_PREFIX)}
        if totals:
            self._gf.stats.assign_totals(totals)

    def _on_new_state(self, state) -> None:
        checkpoint_hints.assign([state], self._positions, self._self_held.hints)
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
        packs = pack_keys_of(state)
        _check(held.meta["sets"][s]["packs"] == packs,
               f"its pack plan {held.meta['sets'][s]['packs']} differs from this run's {packs} "
               f"(another bytes_per_pack, compression or model). Use the same settings")
        prefix = f"s{s}_"
        try:
            state.assign_arrays({key[len(prefix):]: value for key, value in held.arrays.items()
                                 if key.startswith(prefix)})
        except ValueError as error:   # other arrays: other reducer settings than recorded
            _check(False, f"{error} (the reducer's settings differ from the saved run's)")
        held.applied.add(s)
        if len(held.applied) == len(held.meta["sets"]):
            held.meta = held.arrays = None

    # --- the chief's file on another worker (gf_tf.keras.backup) ---------------------

    @contextlib.contextmanager
    def loading_chief_file(self):
        """Within it, a restore of another worker's state (the chief's) is held, not refused,
        for `take_chief_state`; and a checkpoint without reducer state is not warned about."""
        self._self_held.expect_side_file = True
        try:
            yield self
        finally:
            self._self_held.expect_side_file = False

    def take_chief_state(self):
        """(meta, arrays) of the other worker's state the last restore held, or None; cleared."""
        held = self._self_held
        reference, held.reference = held.reference, None
        return reference


def attach(optimizer, strategy, variables) -> None:
    """Gives `optimizer` its GradientFlowCheckpoint if `strategy` all-reduces through GradientFlow."""
    if not gradients.uses_gradient_flow(strategy) or hasattr(optimizer, ATTRIBUTE):
        return
    gradient_flow = tf_internal.strategy_cross_device_ops(strategy)
    with tf.init_scope():
        checkpoint = GradientFlowCheckpoint(gradient_flow, strategy, list(variables),
                                            optimizer.iterations)
    setattr(optimizer, ATTRIBUTE, checkpoint)


def of(optimizer) -> Optional[GradientFlowCheckpoint]:
    """The optimizer's GradientFlowCheckpoint (None before it is built or without GradientFlow)."""
    return getattr(optimizer, ATTRIBUTE, None)
