"""Old public names keep working, each with a DeprecationWarning that names its new home; the
modules 0.2.0 deprecated are gone (0.3.0)."""

import importlib

import pytest
import tensorflow as tf

import gf_tf
from gf_tf.stats import CommStats


@pytest.mark.parametrize("old", ["gf_tf.sparsity", "gf_tf.keras_compat", "gf_tf.checkpoint"])
def test_the_modules_deprecated_in_0_2_0_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert old.split(".")[1] not in gf_tf.__all__


def test_the_csc_reducers_old_selection_attribute_warns_and_is_its_policy():
    reducer = gf_tf.ChunkSparsity(selection="global").reducer()
    with pytest.warns(DeprecationWarning, match=r"CSCReducer\.policy"):
        assert reducer.selection is reducer.policy is gf_tf.csc.POLICIES["global"]


def test_commstats_old_attributes_read_the_counts_with_a_warning():
    stats = CommStats()
    stats.update(dense_bytes=400, sent_bytes=100, selected_chunks=3, total_chunks=7)
    stats.update(dense_bytes=400, sent_bytes=50)
    for name, want, dtype in [("steps", 2, tf.int64), ("dense_bytes", 800.0, tf.float64),
                              ("sent_bytes", 150.0, tf.float64), ("selected_chunks", 3.0, tf.float64),
                              ("total_chunks", 7.0, tf.float64), ("densities", 2.0, tf.float64)]:
        with pytest.warns(DeprecationWarning, match=rf"totals\(\)\['{name}'\]"):
            value = getattr(stats, name)
        assert value.dtype == dtype and value.numpy() == want == stats.totals()[name]


def test_commstats_unknown_attribute_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'sent'"):
        CommStats().sent  # pylint: disable=expression-not-assigned


def test_variable_set_state_old_pack_fields_warn_and_give_the_same_objects():
    from gf_tf import wire
    from gf_tf.packing import plan_packs
    from gf_tf.state import StateRegistry
    signature = [(tf.TensorShape([3]), tf.float32)]
    specs = plan_packs(signature, 0, wire.FP16)
    state = StateRegistry().get([tf.Variable(tf.zeros([3]))], signature, specs,
                                lambda p: (None, [None] * len(p)))
    with pytest.warns(DeprecationWarning, match="pack_specs"):
        assert state.plan is state.pack_specs is specs
    with pytest.warns(DeprecationWarning, match="pack_states"):
        assert state.packs is state.pack_states
