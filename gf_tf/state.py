"""GradientFlow state per variable set: the pack plan and each pack's reducer state.

The state of compressed gradients (CSC residuals, velocities, step counters)
belongs to the variables whose gradients it holds. `StateRegistry` keys it by
the identity of those variables (the Python objects, checked through weak
references), so two models of identical shape, two optimizers or two
`tf.function`s never share it, and a retrace with the same variables (a
smaller last batch, a new input signature) keeps it.
"""

import logging
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf.packing import PackSpec

_log = logging.getLogger(__name__)


class VariableSetState(tf.Module):
    """What GradientFlow keeps for the gradients of one list of variables.

    name: human-readable, e.g. "3 variables: dense/kernel, dense/bias, out/kernel".
    plan: the PackSpecs of this set's gradients.
    packs: per pack, the reducer's state (e.g. `gf_tf.sparsity.CSCState`) or None.
    """

    def __init__(self, name: str, variables: Sequence, signature, plan: Tuple[PackSpec, ...],
                 packs: List[Optional[tf.Module]]):
        super().__init__(name=None)
        self.set_name = name
        self.signature = tuple(signature)
        self.plan = plan
        self.packs = packs
        self._refs = [_weak(v) for v in variables]

    def serves(self, variables: Sequence) -> bool:
        """True if `variables` are exactly this set's variables (same objects, same order)."""
        return len(variables) == len(self._refs) and all(
            ref() is v for ref, v in zip(self._refs, variables))

    def overlaps(self, variables: Sequence) -> bool:
        mine = {id(ref()) for ref in self._refs if ref() is not None}
        return any(id(v) in mine for v in variables)

    @property
    def has_state(self) -> bool:
        return any(p is not None for p in self.packs)


class StateRegistry:
    """The VariableSetStates of one GradientFlowAllReduce (thread-safe: replica threads trace at once)."""

    def __init__(self):
        self._sets: Dict[Tuple[int, ...], VariableSetState] = {}
        self._lock = threading.Lock()

    def get(self, variables: Sequence, signature, plan: Tuple[PackSpec, ...],
            create_pack_state: Callable[[PackSpec], Optional[tf.Module]]) -> VariableSetState:
        """The state of `variables`, created (eagerly, outside any scope) on first use.

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
                packs = [create_pack_state(pack) for pack in plan]
            state = VariableSetState(describe(variables), variables, signature, plan, packs)
            self._sets[key] = state
            return state

    def states(self) -> Dict[str, VariableSetState]:
        """The live variable-set states by name."""
        with self._lock:
            return {s.set_name: s for s in self._sets.values()}

    def clear(self) -> None:
        with self._lock:
            self._sets = {}


def describe(variables: Sequence) -> str:
    """'N variables: a, b, ..., z' from the variables' paths (Keras 3) or names."""
    names = [str(getattr(v, "path", None) or getattr(v, "name", "?")) for v in variables]
    shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
    return f"{len(names)} variable{'s' if len(names) != 1 else ''}: {', '.join(shown)}"


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:     # objects without weak references are held strongly
        return lambda: obj
