"""SavedModel, `model.export` and `tf.train.Checkpoint.write` inside a tf.function, after training.

`tf.saved_model.save` traces every object's `_serialize_to_tensors` and
`_restore_from_tensors` into tf.functions (TF 2.21
saved_model/tracing_utils.py::trace_save_and_restore), so gf_tf's CSC state
object must serialize with TF ops. The saved models are loaded and served in a
fresh process where gf_tf cannot be imported. In-process training: 2 replicas
of a MirroredStrategy over logical CPUs, real `model.fit` steps.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.keras import checkpoint

DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
SETTINGS = {"fp16": None, "csc": dict(density=0.5, chunk_size=8, warmup_steps=0, momentum=0.5)}


def _setup(settings, seed=0):
    csc = gf_tf.ChunkSparsity(**SETTINGS[settings]) if SETTINGS[settings] else None
    gfar = gf_tf.GradientFlowAllReduce(sparsity=csc,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return gfar, model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    return x, (x @ rng.normal(size=(8, 3))).astype(np.float32)


def _fit(model, epochs=1):
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def _trained(settings):
    gfar, model = _setup(settings)
    _fit(model)
    if settings == "csc":
        residuals = checkpoint.of(model.optimizer).state_arrays()[1]
        assert np.any(residuals["s0_p0_residual_r1"])   # error feedback to save
    return gfar, model


_SERVE = """
import sys
sys.modules["gf_tf"] = None   # any import of gf_tf fails
import numpy as np
import tensorflow as tf
x = tf.constant(np.load(sys.argv[1]))
saved_model = tf.saved_model.load(sys.argv[2])
np.save(sys.argv[4], saved_model.signatures["serving_default"](inputs=x)["output_0"].numpy())
exported = tf.saved_model.load(sys.argv[3])
np.save(sys.argv[5], exported.serve(x).numpy())
"""


def _served_without_gf_tf(tmp_path, saved_model_dir, export_dir, x):
    """The outputs for `x` of a `tf.saved_model.save` directory (its "serving_default" signature)
    and of a `model.export` directory (its `serve` endpoint), computed in a fresh process where
    gf_tf cannot be imported."""
    paths = [str(tmp_path / name) for name in ("x.npy", "saved_model.npy", "export.npy")]
    np.save(paths[0], x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", _SERVE, paths[0], saved_model_dir, export_dir,
                             *paths[1:]], cwd=str(tmp_path), env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(paths[1]), np.load(paths[2])


@pytest.mark.slow
@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_saved_model_and_export_after_training_serve_without_gf_tf(tmp_path, settings):
    """tf.saved_model.save and model.export after a fit; both serve the trained model's outputs
    where gf_tf is not installed (no gf_tf op, no Python callback in their graphs)."""
    _, model = _trained(settings)
    saved_model_dir, export_dir = str(tmp_path / "saved_model"), str(tmp_path / "export")
    tf.saved_model.save(model, saved_model_dir)
    model.export(export_dir)
    x = _data(seed=1)[0][:5]
    expected = model(x, training=False).numpy()
    for served in _served_without_gf_tf(tmp_path, saved_model_dir, export_dir, x):
        np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-6)


def _restored_arrays(path, settings):
    """The CSC state arrays a fresh model+optimizer holds after an eager restore of `path`."""
    _, model = _setup(settings, seed=7)
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).assert_consumed()
    return model, checkpoint.of(model.optimizer).state_arrays()


@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_checkpoint_write_inside_a_tf_function_saves_the_state_of_each_call(tmp_path, settings):
    """The function is traced after epoch 1 and called again after epoch 2: the second file
    holds epoch 2's state (read when the function runs, not when it was traced), bit for bit,
    and a restored model trains on exactly as the uninterrupted one."""
    _, model = _trained(settings)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    write = tf.function(lambda path: ckpt.write(path))
    write(tf.constant(str(tmp_path / "epoch1")))
    _fit(model)
    meta, arrays = checkpoint.of(model.optimizer).state_arrays()
    path = write(tf.constant(str(tmp_path / "epoch2"))).numpy().decode()

    restored_model, (restored_meta, restored) = _restored_arrays(path, settings)
    assert restored_meta == meta and restored.keys() == arrays.keys()
    csc_arrays = [key for key in arrays if not key.startswith("comm_")]
    assert (len(csc_arrays) > 0) == (settings == "csc")
    assert int(restored["comm_steps"]) == 8   # the CommStats totals, read when the function ran
    for key, value in arrays.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    if settings == "csc":
        assert int(restored["s0_p0_step_r0"]) == 8
    _fit(model)
    _fit(restored_model)
    for a, b in zip(model.get_weights(), restored_model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for key, value in checkpoint.of(model.optimizer).state_arrays()[1].items():
        np.testing.assert_array_equal(checkpoint.of(restored_model.optimizer).state_arrays()[1][key],
                                      value, err_msg=key)


def test_checkpoint_of_the_npz_format_still_restores(tmp_path, monkeypatch):
    """Checkpoints written before SavedModel support held the state as .npz bytes (as side
    files still do): they restore, bit for bit."""
    _, model = _trained("csc")
    meta, arrays = checkpoint.of(model.optimizer).state_arrays()
    with monkeypatch.context() as patch:   # what _serialize_to_tensors wrote then
        patch.setattr(checkpoint.GradientFlowCheckpoint, "_serialize_to_tensors",
                      lambda self: {"csc_state": tf.constant(self.to_bytes())})
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            str(tmp_path / "old"))
    assert checkpoint.of(model.optimizer).to_bytes()[:2] == b"PK"
    _, (restored_meta, restored) = _restored_arrays(path, "csc")
    assert restored_meta == meta and restored.keys() == arrays.keys()
    for key, value in arrays.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)


def test_restore_in_a_graph_outside_a_saved_model_is_refused():
    """TF's checkpoint protocol called in a tf.function (tf.train.Checkpoint.read itself
    cannot run there): the state's checks run in Python, so it refuses, never drops it."""
    _, model = _trained("csc")
    state = checkpoint.of(model.optimizer)
    restore = tf.function(lambda data: state._restore_from_tensors({"csc_state": data}))  # pylint: disable=protected-access
    with pytest.raises(RuntimeError, match="cannot be restored inside a tf.function"):
        restore(tf.constant(state.to_bytes()))
