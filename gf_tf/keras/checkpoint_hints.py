"""Hints in checkpoints: what a reducer keeps that is not state (`Reducer.create_hints`: the dense
reducer's FP16 bounds a step ahead), saved beside the state so that a resumed run sends its next
step as the uninterrupted one would, and restored wherever key and shape match. Never checked: a
missing or other hint costs a float32 retry, never a value (docs/fp16.md, "A step ahead")."""

from typing import Callable, Dict, Iterable, Optional, Sequence

import numpy as np

HINT_PREFIX = "hint_"


def hints_of(states: Iterable, positions_of: Callable[[object], Optional[Sequence[int]]],
             read: Callable) -> Dict[str, object]:
    """{"hint_<first position>x<variable count>_<key>": read(variable)} of the hints of each
    `gf_tf.state.VariableSetState` whose variables are all the optimizer's (`positions_of`: their
    positions in its list, or None), by `VariableSetState.hint_variables` key (dense: p{p}_bound_r{r})."""
    out = {}
    for state in states:
        positions = positions_of(state)
        if positions is not None:
            out.update({f"{HINT_PREFIX}{positions[0]}x{len(positions)}_{key}": read(v)
                        for key, v in state.hint_variables().items()})
    return out


def saved(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The hints among a checkpoint's arrays."""
    return {key: value for key, value in arrays.items() if key.startswith(HINT_PREFIX)}


def assign(states: Iterable, positions_of, held: Dict[str, np.ndarray]) -> None:
    """Assigns the `states`' hints from `held` (restored arrays) where key and shape match."""
    for key, variable in hints_of(states, positions_of, lambda v: v).items():
        value = held.get(key)
        if value is not None and np.shape(value) == tuple(variable.shape):
            variable.assign(value)
