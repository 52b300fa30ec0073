"""gf_tf.state: the state of each variable set, keyed by the variables themselves."""

import tensorflow as tf

from gf_tf import wire
from gf_tf.packing import plan_packs
from gf_tf.state import StateRegistry


def test_two_variable_sets_with_the_same_names_show_as_two_states():
    """states() once was keyed by display name, so two models' sets of
    identically named variables showed as one; the states themselves were apart."""
    registry = StateRegistry()
    signature = [(tf.TensorShape([3]), tf.float32)]
    plan = plan_packs(signature, 0, wire.FORMATS["fp16"])
    models = [[tf.Variable(tf.zeros([3]), name="dense/kernel")] for _ in range(3)]
    sets = [registry.get(v, signature, plan,
                         lambda p: (None, [None] * len(p))) for v in models]
    assert len({id(s) for s in sets}) == 3
    states = registry.states()
    assert list(states) == ["1 variable: dense/kernel:0", "1 variable: dense/kernel:0 (#2)",
                            "1 variable: dense/kernel:0 (#3)"]
    assert [id(s) for s in states.values()] == [id(s) for s in sets]


class Counter(tf.Module):
    def __init__(self):
        super().__init__()
        self.calls = tf.Variable(0)

    def to_arrays(self):
        return {"calls": self.calls.numpy()}

    def assign_arrays(self, arrays):
        self.calls.assign(arrays["calls"])


def test_a_state_is_serializable_when_every_part_turns_into_arrays_and_back():
    """The first-trace trial (gf_tf.route) runs a reducer's step and puts its state back only
    where every part can; elsewhere it keeps the model's pick."""
    signature = [(tf.TensorShape([3]), tf.float32)]
    plan = plan_packs(signature, 0, wire.FORMATS["fp16"])
    for shared, packs, serializable in [(None, [None], True), (Counter(), [None], True),
                                        (Counter(), [tf.Module()], False)]:
        state = StateRegistry().get([tf.Variable(tf.zeros([3]))], signature, plan,
                                    lambda p, s=shared, k=packs: (s, k))
        assert state.serializable is serializable
    state = StateRegistry().get([tf.Variable(tf.zeros([3]))], signature, plan,
                                lambda p: (Counter(), [None]))
    before = state.to_arrays()
    state.shared.calls.assign_add(6)
    state.assign_arrays(before)
    assert int(state.shared.calls.numpy()) == 0
