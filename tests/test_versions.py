"""The supported matrix is written once (tf_internal, keras_compat) and enforced with clear errors."""

import pytest
import tensorflow as tf

from gf_tf import keras_compat, tf_internal

SUPPORTED_TF = ("2.18", "2.19", "2.20", "2.21")


@pytest.mark.parametrize("version", ["2.18.0", "2.19.1", "2.20.0", "2.21.0"])
def test_every_tested_tensorflow_passes_the_check(version):
    tf_internal.check_tf_version(version)


@pytest.mark.parametrize("version", ["2.17.1", "2.22.0", "3.0.0"])
def test_untested_tensorflow_fails_naming_the_supported_range(version):
    with pytest.raises(RuntimeError, match=rf"tested with TensorFlow 2\.18-2\.21 .*found TensorFlow {version}"):
        tf_internal.check_tf_version(version)


def test_the_tested_versions_are_the_matrix():
    assert tf_internal.TESTED_TF_VERSIONS == SUPPORTED_TF
    assert keras_compat.TESTED_TF_KERAS_VERSIONS == SUPPORTED_TF
    assert keras_compat.TESTED_KERAS_VERSIONS == ("3.15",)


@pytest.mark.parametrize("version", ["3.14.0", "3.16.0", "2.15.0"])
def test_untested_keras3_fails_naming_the_tested_one(version):
    with pytest.raises(RuntimeError, match=rf"tested with Keras 3\.15\.x only; found Keras {version}"):
        keras_compat.check_keras_version(version, tf_keras=False)


def test_tf_keras_must_match_the_tensorflow_minor_version():
    running = ".".join(tf.__version__.split(".")[:2])
    keras_compat.check_keras_version(running + ".0", tf_keras=True)
    other = "2.18" if running != "2.18" else "2.19"
    with pytest.raises(RuntimeError, match=rf"found tf-keras {other}\.0 with TensorFlow {tf.__version__}"):
        keras_compat.check_keras_version(other + ".0", tf_keras=True)
    with pytest.raises(RuntimeError, match="tested with tf-keras 2.18, 2.19, 2.20, 2.21"):
        keras_compat.check_keras_version("2.15.1", tf_keras=True)


def test_the_running_versions_pass():
    tf_internal.check_tf_version()
    keras_compat.check_keras_version()


def test_flavour_follows_tf_use_legacy_keras(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert keras_compat.uses_tf_keras() and keras_compat.flavour() == "tf-keras"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    assert not keras_compat.uses_tf_keras() and keras_compat.flavour() == "keras"
    monkeypatch.delenv("TF_USE_LEGACY_KERAS")
    assert keras_compat.flavour() == "keras"
