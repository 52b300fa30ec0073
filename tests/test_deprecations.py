"""Old public names keep working, each with a DeprecationWarning that names its new home."""

import importlib

import pytest
import tensorflow as tf

import gf_tf
from gf_tf.stats import CommStats


@pytest.mark.parametrize("old, new, name", [
    ("gf_tf.sparsity", "gf_tf.csc", "ChunkSparsity"),
    ("gf_tf.keras_compat", "gf_tf.keras", "install"),
    ("gf_tf.checkpoint", "gf_tf.keras.backup", "BackupAndRestore"),
])
def test_an_old_module_warns_and_gives_the_same_objects(old, new, name):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.reload(module)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_csc_reducers_old_selection_attribute_warns_and_is_its_policy():
    reducer = gf_tf.ChunkSparsity(selection="global").reducer()
    with pytest.warns(DeprecationWarning, match=r"CSCReducer\.policy"):
        assert reducer.selection is reducer.policy is gf_tf.csc.POLICIES["global"]


def test_old_modules_are_still_attributes_of_the_package():
    assert gf_tf.checkpoint.BackupAndRestore is gf_tf.keras.backup.BackupAndRestore
    assert gf_tf.ChunkSparsity is gf_tf.csc.ChunkSparsity


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
