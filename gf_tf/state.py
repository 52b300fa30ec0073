"""GradientFlow state per variable set: its pack specs and the reducer's state of the set and its packs.

The state of compressed gradients (CSC residuals, velocities, step counters)
belongs to the variables whose gradients it holds. `StateRegistry` keys it by
the identity of those variables (the Python objects, checked through weak
references), so two models of identical shape, two optimizers or two
`tf.function`s never share it, and a retrace with the same variables (a
smaller last batch, a new input signature) keeps it.
"""

import logging
import threading
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from gf_tf.packing import PackSpec

_log = logging.getLogger(__name__)


class VariableSetState(tf.Module):
    """What GradientFlow keeps for the gradients of one list of variables.

    name: human-readable, e.g. "3 variables: dense/kernel, dense/bias, out/kernel".
    pack_specs: the `gf_tf.packing.PackSpec`s of this set's gradients.
    shared: the reducer's state of the whole set (e.g. `gf_tf.csc.CSCSetState`: the
      step counters) or None.
    pack_states: per pack spec, the reducer's state (e.g. `gf_tf.csc.CSCState`) or None.
    hints: per pack spec, what the reducer keeps that is not state (`Reducer.create_hints`,
      e.g. the dense reducer's `ScaleAhead`; saved beside the state, never checked) or None.
    planned: the `gf_tf.plan.Planned` (plan and forecast) its gradients travel by.
    trial: with a trial plan, its `gf_tf.plan.trial.Decision` (taken at the first trace; not
      checkpointed), else None.
    """

    def __init__(self, name: str, variables: Sequence, signature,
                 pack_specs: Tuple[PackSpec, ...], shared: Optional[tf.Module],
                 pack_states: List[Optional[tf.Module]], hints: Optional[list] = None):
        super().__init__(name=None)
        self.set_name = name
        self.signature = tuple(signature)
        self.pack_specs = pack_specs
        self.shared = shared
        self.pack_states = pack_states
        self.hints = hints if hints is not None else [None] * len(pack_specs)
        self.planned = None   # the gf_tf.plan.Planned it travels by, set on first use
        self.trial = None
        self._refs = [_weak(v) for v in variables]

    @property
    def plan(self) -> Tuple[PackSpec, ...]:
        """Deprecated name of `pack_specs`."""
        _deprecated("plan", "pack_specs")
        return self.pack_specs

    @property
    def packs(self) -> List[Optional[tf.Module]]:
        """Deprecated name of `pack_states`."""
        _deprecated("packs", "pack_states")
        return self.pack_states

    def owners(self) -> list:
        """The variables whose gradients this set holds (None where one was garbage-collected)."""
        return [ref() for ref in self._refs]

    def serves(self, variables: Sequence) -> bool:
        """True if `variables` are exactly this set's variables (same objects, same order)."""
        return len(variables) == len(self._refs) and all(
            ref() is v for ref, v in zip(self._refs, variables))

    def overlaps(self, variables: Sequence) -> bool:
        mine = {id(ref()) for ref in self._refs if ref() is not None}
        return any(id(v) in mine for v in variables)

    @property
    def has_state(self) -> bool:
        return self.shared is not None or any(p is not None for p in self.pack_states)

    @property
    def serializable(self) -> bool:
        """Every part of the reducer's state turns itself into arrays and back (`to_arrays`,
        `assign_arrays`; True without state)."""
        return all(hasattr(part, "to_arrays") and hasattr(part, "assign_arrays")
                   for _, part in self._parts())

    def hint_variables(self) -> Dict[str, tf.Variable]:
        """The hints' variables (`Reducer.create_hints`) by key: pack p's "p{p}_<its key>"."""
        return {f"p{p}_{key}": v for p, hints in enumerate(self.hints)
                for key, v in getattr(hints, "named_variables", dict)().items()}

    def _parts(self) -> List[Tuple[str, tf.Module]]:
        """(key prefix, state) of the set's state (prefix "") and of each pack p's ("p{p}_")."""
        parts = [("", self.shared)] + [(f"p{p}_", pack)
                                       for p, pack in enumerate(self.pack_states)]
        return [(prefix, part) for prefix, part in parts if part is not None]

    def _part_arrays(self) -> List[Tuple[str, tf.Module, Dict[str, np.ndarray]]]:
        """(key prefix, state, its arrays) of each of `_parts`."""
        return [(prefix, part, part.to_arrays()) for prefix, part in self._parts()]

    def to_arrays(self) -> Dict[str, np.ndarray]:
        """The set's reducer state as arrays (eager), by stable string keys: the set
        state's own keys, then each pack p's keys prefixed "p{p}_" (CSC: "p0_step_r0",
        "p0_residual_r0", ...). {} without state."""
        return {prefix + key: value for prefix, _, arrays in self._part_arrays()
                for key, value in arrays.items()}

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """The keys of `to_arrays`, as tensors read from the state's variables: eagerly,
        or inside a tf.function (read when the function runs)."""
        return {prefix + key: value for prefix, part in self._parts()
                for key, value in part.to_tensors().items()}

    def assign_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        """Assigns what `to_arrays` gave (eager).

        Raises:
          ValueError naming the missing or extra keys, or a key whose shape differs.
        """
        parts = self._part_arrays()
        expected = {prefix + key: value for prefix, _, own in parts for key, value in own.items()}
        optional = {prefix + key for prefix, part, _ in parts
                    for key in getattr(part, "optional_keys", ())}
        missing = sorted(set(expected) - set(arrays) - optional)
        extra = sorted(set(arrays) - set(expected) - optional)
        if missing or extra:
            raise ValueError(f"gf_tf: the state of variable set [{self.set_name}] has other "
                             f"arrays: missing {missing}, extra {extra}")
        for key, value in expected.items():
            if key in arrays and np.shape(arrays[key]) != np.shape(value):
                raise ValueError(f"gf_tf: array {key!r} of variable set [{self.set_name}] has "
                                 f"shape {np.shape(arrays[key])}, the state has {np.shape(value)}")
        for prefix, part, own in parts:
            part.assign_arrays({key: arrays[prefix + key] for key in own if prefix + key in arrays})


class StateRegistry:
    """The VariableSetStates of one GradientFlowAllReduce (thread-safe: replica threads trace at once)."""

    def __init__(self):
        self._sets: Dict[Tuple[int, ...], VariableSetState] = {}
        self._lock = threading.Lock()
        self._listeners = []   # weak references to callables(VariableSetState)

    def add_listener(self, listener: Callable[[VariableSetState], None]) -> None:
        """Calls `listener(state)` (a bound method, held weakly) for every set created from now on.

        It runs eagerly under the registry's lock, before the state's first use,
        so it may assign the state's variables (a deferred checkpoint restore,
        gf_tf.keras.checkpoint) or raise to stop the trace.
        """
        self._listeners.append(weakref.WeakMethod(listener))

    def get(self, variables: Sequence, signature, pack_specs: Tuple[PackSpec, ...],
            create_states: Callable[[Tuple[PackSpec, ...]],
                                    Tuple[Optional[tf.Module], List[Optional[tf.Module]]]],
            create_hints: Optional[Callable[[Tuple[PackSpec, ...]], list]] = None
            ) -> VariableSetState:
        """The state of `variables`, created (eagerly, outside any scope) on first use.

        create_states(pack_specs) -> (the set's reducer state, per pack its state), as
        `gf_tf.reducers.Reducer.create_states`; create_hints(pack_specs) -> per pack its hints,
        as `gf_tf.reducers.Reducer.create_hints` (None: none).

        A set whose gradient signature changed, or an older set that shares
        variables with a new one (e.g. a layer frozen between `fit` calls),
        is dropped; when it held state, one warning names it.
        """
        key = tuple(id(v) for v in variables)
        with self._lock:
            state = self._sets.get(key)
            if state is not None and state.serves(variables) and state.signature == tuple(signature):
                return state
            for old_key, old in list(self._sets.items()):
                if old_key == key or old.overlaps(variables):
                    del self._sets[old_key]
                    if old.has_state:
                        _log.warning(
                            "gf_tf: the gradients of variable set [%s] changed (now %s); its "
                            "compression state (residuals, momentum, step counter) starts again "
                            "from zero with a fresh warm-up.", old.set_name, describe(variables))
            with tf.init_scope():
                shared, pack_states = create_states(pack_specs)
                hints = create_hints(pack_specs) if create_hints is not None else None
            state = VariableSetState(describe(variables), variables, signature, pack_specs,
                                     shared, list(pack_states), hints)
            with tf.init_scope():
                for ref in list(self._listeners):
                    if ref() is not None:
                        ref()(state)
            self._sets[key] = state
            return state

    def all_states(self) -> List[VariableSetState]:
        """The live variable-set states, oldest first."""
        with self._lock:
            return list(self._sets.values())

    def states(self) -> Dict[str, VariableSetState]:
        """The live variable-set states by name, oldest first; a set whose name an older one
        already has (variables of the same names in two models) is "NAME (#2)", "NAME (#3)", ..."""
        with self._lock:
            named = {}
            for state in self._sets.values():
                name, count = state.set_name, 1
                while name in named:
                    count += 1
                    name = f"{state.set_name} (#{count})"
                named[name] = state
            return named

    def clear(self) -> None:
        with self._lock:
            self._sets = {}


def describe(variables: Sequence) -> str:
    """'N variables: a, b, ..., z' from the variables' paths (Keras 3) or names."""
    names = [str(getattr(v, "path", None) or getattr(v, "name", "?")) for v in variables]
    shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
    return f"{len(names)} variable{'s' if len(names) != 1 else ''}: {', '.join(shown)}"


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"VariableSetState.{old} is deprecated: use VariableSetState.{new}",
                  DeprecationWarning, stacklevel=3)


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:     # objects without weak references are held strongly
        return lambda: obj
