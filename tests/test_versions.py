"""The supported matrix is written once (tf_internal, gf_tf.keras.flavour) and enforced with clear errors;
the Keras wing (gf_tf/keras/) is the one place that knows Keras, and the core imports none of it."""

import importlib
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import gf_tf
from gf_tf import tf_internal
from gf_tf.keras import flavour, patches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUPPORTED_TF = ("2.18", "2.19", "2.20", "2.21")
TESTED_KERAS3 = ("3.6", "3.7", "3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14", "3.15")   # the noxfile cells that passed (README "Supported versions")


@pytest.mark.parametrize("version", ["2.18.0", "2.19.1", "2.20.0", "2.21.0"])
def test_every_tested_tensorflow_passes_the_check(version):
    tf_internal.check_tf_version(version)


@pytest.mark.parametrize("version", ["2.17.1", "2.22.0", "3.0.0"])
def test_untested_tensorflow_fails_naming_the_supported_range(version):
    with pytest.raises(RuntimeError, match=rf"tested with TensorFlow 2\.18-2\.21 .*found TensorFlow {version}"):
        tf_internal.check_tf_version(version)


def test_the_tested_versions_are_the_matrix():
    assert tf_internal.TESTED_TF_VERSIONS == SUPPORTED_TF
    assert flavour.TESTED_TF_KERAS_VERSIONS == SUPPORTED_TF
    assert flavour.TESTED_KERAS_VERSIONS == TESTED_KERAS3


@pytest.mark.parametrize("minor", TESTED_KERAS3)
def test_every_tested_keras3_minor_passes_the_check(minor):
    flavour.check_keras_version(f"{minor}.0", tf_keras=False)
    flavour.check_keras_version(f"{minor}.9", tf_keras=False)


@pytest.mark.parametrize("version", ["3.5.0", "3.16.0", "4.0.0", "2.15.0"])   # no cell passed
def test_untested_keras3_fails_naming_the_tested_ones(monkeypatch, version):
    monkeypatch.delenv(flavour.KERAS_UNDER_TEST_ENV, raising=False)   # a keras3.N cell sets it
    tested = re.escape(", ".join(TESTED_KERAS3))
    with pytest.raises(RuntimeError, match=rf"tested with Keras {tested} only; found Keras {version}"):
        flavour.check_keras_version(version, tf_keras=False)


def test_a_matrix_cell_accepts_its_own_keras3_minor_and_no_other(monkeypatch):
    monkeypatch.setenv(flavour.KERAS_UNDER_TEST_ENV, "3.16")   # what noxfile sets in a keras3.16 cell
    flavour.check_keras_version("3.16.2", tf_keras=False)
    with pytest.raises(RuntimeError, match="found Keras 3.5.0"):
        flavour.check_keras_version("3.5.0", tf_keras=False)


@pytest.mark.parametrize("running, applies", [("3.6.0", (True, True, False)), ("3.7.1", (True, False, True)),
                                              ("3.15.1", (True, False, True))])
def test_a_keras3_patch_applies_within_its_since_before_minors(monkeypatch, running, applies):
    monkeypatch.setattr(importlib.import_module("keras"), "__version__", running)
    marked = [patches.Patch("m", "a", ("keras",), lambda f: f, "r"),
              patches.Patch("m", "a", ("keras",), lambda f: f, "r", before="3.7"),
              patches.Patch("m", "a", ("keras",), lambda f: f, "r", since="3.7")]
    assert tuple(patches.applies_to_running_keras(p) for p in marked) == applies


def test_tf_keras_must_match_the_tensorflow_minor_version():
    running = ".".join(tf.__version__.split(".")[:2])
    flavour.check_keras_version(running + ".0", tf_keras=True)
    other = "2.18" if running != "2.18" else "2.19"
    with pytest.raises(RuntimeError, match=rf"found tf-keras {other}\.0 with TensorFlow {tf.__version__}"):
        flavour.check_keras_version(other + ".0", tf_keras=True)
    with pytest.raises(RuntimeError, match="tested with tf-keras 2.18, 2.19, 2.20, 2.21"):
        flavour.check_keras_version("2.15.1", tf_keras=True)


def test_the_running_versions_pass():
    tf_internal.check_tf_version()
    flavour.check_keras_version()


def test_flavour_follows_tf_use_legacy_keras(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert flavour.uses_tf_keras() and flavour.flavour() == "tf-keras"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    assert not flavour.uses_tf_keras() and flavour.flavour() == "keras"
    monkeypatch.delenv("TF_USE_LEGACY_KERAS")
    assert flavour.flavour() == "keras"


# --- the Keras wing and the core ---------------------------------------------------------

KERAS_FREE_CORE = """
import sys
sys.modules["keras"] = sys.modules["tf_keras"] = None   # no Keras here: importing one fails
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import gf_tf, gf_tf.cross_device_ops, gf_tf.reducers, gf_tf.ops, gf_tf.stats, gf_tf.csc
loaded = [m for m, module in sys.modules.items() if module is not None and (
    m == "keras" or m.startswith(("keras.", "tf_keras", "gf_tf.keras")))]
print("keras modules:", loaded)
print(gf_tf.GradientFlowAllReduce(compression="bf16"))
# A gradient all-reduce through the core alone: FP16 packs, checked against float64.
rng = np.random.default_rng()
values = [rng.standard_normal((2, 1009)).astype(np.float32), rng.standard_normal((2, 7)).astype(np.float32)]
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=gf_tf.GradientFlowAllReduce())
with strategy.scope():
    variables = [tf.Variable(tf.zeros(v.shape[1:])) for v in values]
@tf.function
def step():
    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return gf_tf.all_reduce_gradients([tf.identity(tf.gather(tf.constant(v), r)) for v in values], variables)
    return strategy.run(replica_fn)
got = [strategy.experimental_local_results(t)[0].numpy() for t in step()]
want = [v.astype(np.float64).sum(axis=0) for v in values]
print("max relative error:", max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want)))
"""


@pytest.mark.slow
def test_the_core_imports_and_runs_without_keras():
    """TensorFlow imports Keras by itself when one is installed, so the core is tried with none."""
    out = subprocess.run([sys.executable, "-c", KERAS_FREE_CORE], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3"),
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "keras modules: []" in out.stdout, out.stdout
    assert "GradientFlowAllReduce(compression='bf16'" in out.stdout, out.stdout
    error = float(out.stdout.rsplit("max relative error:", 1)[1])
    assert error < 2e-3, out.stdout   # FP16 rounding of the sum (11 significant bits)


def _target(module, attribute):
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, name)


def test_a_gradient_flow_all_reduce_installs_every_patch_of_the_running_keras_once():
    gf_tf.GradientFlowAllReduce()
    gf_tf.GradientFlowAllReduce()   # installing again wraps nothing twice
    active = [p for p in patches.PATCHES if flavour.patched_flavours().intersection(p.flavours)
              and patches.applies_to_running_keras(p)]
    assert (flavour.flavour(),) in {p.flavours for p in active}
    for patch in active:
        installed = _target(patch.module, patch.attribute)
        assert getattr(installed, "_gf_tf_patch", False), patch
        assert not getattr(installed.__wrapped__, "_gf_tf_patch", False), patch


def test_the_private_keras_names_gf_tf_overrides_exist_and_are_overridden():
    from gf_tf.keras import backup, checkpoint  # pylint: disable=import-outside-toplevel
    for override in patches.OVERRIDES:
        keras_name = _target(override.module, override.attribute)   # still a Keras name
        ours = getattr(checkpoint, override.by, None) or getattr(backup, override.by)
        if "." in override.attribute:
            assert override.attribute.split(".")[-1] in vars(ours), override
        else:
            assert issubclass(ours, keras_name), override


def test_the_package_face_names_the_keras_wing_s_callback():
    from gf_tf.keras import callbacks  # pylint: disable=import-outside-toplevel
    assert gf_tf.GradientFlowStats is callbacks.GradientFlowStats
