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
