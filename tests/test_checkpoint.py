"""CSC state (residuals, velocities, step counters) in Keras checkpoints: gf_tf.keras.checkpoint.

In-process, 2 replicas of a MirroredStrategy over logical CPUs. The 2-worker
SIGKILL / BackupAndRestore run is in tests/test_checkpoint_multiworker.py.
"""

import logging
import math

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.keras import backup, checkpoint
from gf_tf.keras.checkpoint_checks import CheckpointMismatchError, check_reducer
from gf_tf.strategy import WorkerInfo
from helpers import regression_data, small_keras_model



def _setup(seed=0, momentum=0.5, sparsity=True, devices=2, bytes_per_pack=4 << 20, hidden=16,
           compression="fp16", reducer=None, density=0.1):
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=8, warmup_steps=2,
                              momentum=momentum) if sparsity and reducer is None else None
    gfar = gf_tf.GradientFlowAllReduce(sparsity=csc, bytes_per_pack=bytes_per_pack, compression=compression,
                                       reducer=reducer,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    return small_keras_model(gfar, devices, seed, hidden)


_data = regression_data


def _state(gfar):
    (variable_set,) = gfar.states().values()
    return variable_set.pack_states[0]


def _snapshot(state):
    return {"steps": [int(s.numpy()) for s in state.steps],
            "residuals": [r.numpy().copy() for r in state.residuals],
            "velocities": [u.numpy().copy() for u in state.velocities or []]}


def _trained(tmp_path, epochs=1, **kw):
    gfar, model = _setup(**kw)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    path = str(tmp_path / "a.weights.h5")
    model.save_weights(path)
    return gfar, model, path


def test_save_weights_holds_each_replicas_state(tmp_path):
    gfar, _, path = _trained(tmp_path)
    saved = _snapshot(_state(gfar))
    assert saved["steps"] == [4, 4] and np.any(saved["residuals"][1])
    with h5py.File(path, "r") as f:
        group = f["optimizer/_gf_tf_checkpoint/vars"]
        np.testing.assert_array_equal(group["s0_p0_residual_r1"][()], saved["residuals"][1])
        np.testing.assert_array_equal(group["s0_p0_velocity_r0"][()], saved["velocities"][0])
        assert int(group["s0_p0_step_r0"][()]) == 4


def test_load_weights_before_the_first_step_is_applied_when_the_state_is_created(tmp_path):
    """load_weights into a fresh model (no GradientFlow state yet) then fit: the
    held state is applied at the trace, so training continues exactly as an
    uninterrupted run (bitwise)."""
    x, y = _data()
    gfar_a, model_a = _setup()
    model_a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    gfar_b, model_b, path = _trained(tmp_path)
    gfar_c, model_c = _setup(seed=7)
    model_c.optimizer.build(model_c.trainable_variables)
    model_c.load_weights(path)
    assert gfar_c.states() == {}
    model_c.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert _snapshot(_state(gfar_c))["steps"] == [8, 8]
    for a, c in zip(model_a.get_weights(), model_c.get_weights()):
        np.testing.assert_array_equal(a, c)
    a, c = _snapshot(_state(gfar_a)), _snapshot(_state(gfar_c))
    for r in range(2):
        np.testing.assert_array_equal(a["residuals"][r], c["residuals"][r])
        np.testing.assert_array_equal(a["velocities"][r], c["velocities"][r])


def test_load_weights_after_training_overwrites_the_live_state(tmp_path):
    gfar, model, path = _trained(tmp_path)
    saved = _snapshot(_state(gfar))
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert _snapshot(_state(gfar))["steps"] == [8, 8]
    model.load_weights(path)
    now = _snapshot(_state(gfar))
    assert now["steps"] == saved["steps"]
    for r in range(2):
        np.testing.assert_array_equal(now["residuals"][r], saved["residuals"][r])
        np.testing.assert_array_equal(now["velocities"][r], saved["velocities"][r])


def _load_into(path, **kw):
    gfar, model = _setup(**kw)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    x, y = _data()
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    return gfar


def test_another_replica_count_is_refused(tmp_path):
    _, _, path = _trained(tmp_path)
    with pytest.raises(ValueError, match="saved with 2 replicas per worker, this worker has 3"):
        _load_into(path, devices=3)


def _refused_at_load(path, **kw):
    """load_weights (no step) into a model built with `kw`: the CheckpointMismatchError's message."""
    gfar, model = _setup(**kw)
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(CheckpointMismatchError) as error:
        model.load_weights(path)
    assert gfar.states() == {}   # reported before any step
    return str(error.value)


@pytest.mark.parametrize("setting, then", [
    ({"bytes_per_pack": 64}, "bytes_per_pack 4194304 then, 64 now"),
    ({"compression": None}, "compression 'fp16' then, None now"),
])
def test_another_pack_plan_is_refused_at_load_weights_naming_the_setting(tmp_path, setting, then):
    saved_gfar, _, path = _trained(tmp_path)
    message = _refused_at_load(path, **setting)
    (variable_set,) = saved_gfar.states().values()
    now = gf_tf.GradientFlowAllReduce(**{"compression": "fp16", "bytes_per_pack": 4 << 20, **setting})
    now_plan = gf_tf.packing.plan_packs(variable_set.signature, now.bytes_per_pack,
                                        now.compression)
    assert message.startswith(
        f"gf_tf: cannot restore the checkpoint's reducer state: it was saved with other "
        f"GradientFlowAllReduce settings ({then}): its pack plan "
        f"{[[p.key, p.num_elements] for p in variable_set.pack_specs]} differs from this run's "
        f"{[[p.key, p.num_elements] for p in now_plan]}. Use the same settings.\n\n(Keras: 1 "
        f"object(s) could not be loaded: [<gf_tf.keras.checkpoint.GradientFlowCheckpoint object at"
        ), message


def _shown(gfar):
    """The reducer as a mismatch names it: qualified class (settings as the handshake prints them)."""
    reducer = gfar.reducer
    settings = ", ".join(f"{name} {text(number)}" for name, number, text in reducer.state_settings())
    return f"{type(reducer).__module__}.{type(reducer).__qualname__}({settings})"


def test_momentum_switched_off_is_refused_naming_both_reducers_settings(tmp_path):
    gfar, _, path = _trained(tmp_path)
    now = _setup(momentum=0.0)[0]
    assert _shown(gfar) != _shown(now)   # the settings' CRC32 covers momentum
    with pytest.raises(ValueError, match="it was saved by the reducer gf_tf.csc.reducer.CSCReducer"):
        _load_into(path, momentum=0.0)
    assert _refused_at_load(path, momentum=0.0).startswith(
        f"gf_tf: cannot restore the checkpoint's reducer state: it was saved by the reducer "
        f"{_shown(gfar)} and this run's is {_shown(now)}. Resume with the same reducer and "
        f"settings.\n\n(Keras: 1 object(s)")


@pytest.mark.parametrize("density", [0.05, 0.5, "auto"])
def test_a_checkpoint_restores_into_another_density_and_continues_at_it(tmp_path, density):
    """The density only chooses what a step sends: the residuals, velocities and step counters
    saved at density 0.1 restore bitwise into a run at another density (or "auto"), which goes on
    from the saved step at its own density (195 elements: 25 chunks of 8)."""
    gfar, _, path = _trained(tmp_path)
    saved, saved_totals = _snapshot(_state(gfar)), gfar.stats.totals()
    gfar_b, model_b = _setup(seed=3, density=density)
    restored = {}
    recorder = _Recorder(restored)   # held here: the registry holds its listeners weakly
    model_b.optimizer.build(model_b.trainable_variables)   # attaches the checkpoint's listener
    gfar_b.state_registry.add_listener(recorder.record)
    model_b.load_weights(path)
    x, y = _data()
    model_b.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert restored["steps"] == saved["steps"] == [4, 4]
    for r in range(2):
        np.testing.assert_array_equal(restored["residuals"][r], saved["residuals"][r])
        np.testing.assert_array_equal(restored["velocities"][r], saved["velocities"][r])
    assert _snapshot(_state(gfar_b))["steps"] == [8, 8]
    chunks = gfar_b.stats.totals()["selected_chunks"] - saved_totals["selected_chunks"]
    if density != "auto":
        assert chunks == 4 * math.ceil(density * 25)
    else:   # auto takes a rung from 1.0 down to its floor, 0.01 (1 chunk)
        assert 4 * 1 <= chunks <= 4 * 25


def test_an_auto_checkpoint_restores_into_a_fixed_density(tmp_path):
    gfar, _, path = _trained(tmp_path, density="auto")
    saved = _snapshot(_state(gfar))
    gfar_b = _load_into(path, density=0.1)
    assert _snapshot(_state(gfar_b))["steps"] == [s + 1 for s in saved["steps"]]


def test_the_reducer_check_compares_the_state_settings_it_still_declares():
    reducer = gf_tf.ChunkSparsity(density=0.25, chunk_size=8, momentum=0.5).reducer()
    name = f"{type(reducer).__module__}.{type(reducer).__qualname__}"
    # Saved with every handshake setting (density, CRC32 of all): nothing of it is a state setting.
    check_reducer({"class": name, "settings": [["sparsity density", 0.5],
                                               ["sparsity settings (CRC32)", 12345]]}, reducer)
    check_reducer({"class": name, "settings": None}, reducer)   # format 1
    with pytest.raises(CheckpointMismatchError, match=r"sparsity chunk_size 16, .* and this run's is "
                                                      r".*sparsity chunk_size 8, sparsity momentum 0\.5, "
                                                      r"sparsity selection \(CRC32\) 'per_pack'"):
        check_reducer({"class": name, "settings": [["sparsity chunk_size", 16],
                                                   ["sparsity momentum", 0.5]]}, reducer)


def test_another_variable_list_is_refused_at_load_weights(tmp_path):
    saved_gfar, _, path = _trained(tmp_path)
    gfar, model = _setup()
    model.layers[0].trainable = False
    with model.distribute_strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.optimizer.build(model.trainable_variables)
    (saved,) = saved_gfar.states()
    now = model.trainable_variables
    with pytest.raises(CheckpointMismatchError) as error:
        model.load_weights(path)   # reported here, before any step
    assert str(error.value).startswith(
        f"gf_tf: cannot restore the checkpoint's reducer state: it holds the state of [{saved}] "
        f"(optimizer positions [0, 1, 2, 3], shapes [(8, 16), (16,), (16, 3), (3,)]), but this "
        f"optimizer's trainable variables are [{gf_tf.state.describe(now)}] (shapes [(16, 3), "
        f"(3,)]). Restore into the same model with the same trainable variables, or start "
        f"without the checkpoint's optimizer state.\n\n(Keras: 1 object(s) could not be loaded: "
        f"[<gf_tf.keras.checkpoint.GradientFlowCheckpoint object at"), str(error.value)


def test_another_workers_file_is_refused(tmp_path):
    gfar, _, path = _trained(tmp_path)
    gfar2, model2 = _setup()
    model2.optimizer.build(model2.trainable_variables)
    # As gf_tf.MultiWorkerMirroredStrategy would set it for worker 1 of a 2-worker job.
    gfar2._workers = WorkerInfo(rank=1, names=("worker 0", "worker 1"))  # pylint: disable=protected-access
    with pytest.raises(ValueError, match="saved by a job of 1 workers, this job has 2"):
        model2.load_weights(path)


def _chief_file(tmp_path):
    """A file as the chief of a 2-worker job writes it (worker 0 of 2), after one epoch."""
    gfar, model = _setup()
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    gfar._workers = WorkerInfo(rank=0, names=("worker 0", "worker 1"))  # pylint: disable=protected-access
    path = str(tmp_path / "chief.weights.h5")
    model.save_weights(path)
    return gfar, model, path


def _worker_1():
    gfar, model = _setup(seed=9)
    gfar._workers = WorkerInfo(rank=1, names=("worker 0", "worker 1"))  # pylint: disable=protected-access
    return gfar, model


def test_the_chiefs_file_on_another_worker_is_refused_with_the_recipe(tmp_path):
    _, _, path = _chief_file(tmp_path)
    gfar, model = _worker_1()
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(CheckpointMismatchError) as error:
        model.load_weights(path)
    assert str(error.value).startswith(
        "gf_tf: cannot restore the checkpoint's reducer state: it holds worker 0's state and this is "
        "worker 1. Each worker must load the file it saved itself (or use "
        "gf_tf.keras.backup.BackupAndRestore); to load a file only the chief saved (TF's "
        "multi-worker guide: ModelCheckpoint on the chief) on every worker, call "
        "gf_tf.keras.backup.load_weights_from_chief(model, path) instead of "
        "model.load_weights(path): the chief's weights and optimizer, this worker's "
        "reducer state (CSC: residuals and momentum) from zero (warned).\n\n(Keras: 1 object(s)"), str(error.value)
    assert gfar.states() == {}


def test_load_weights_from_chief_resets_csc_state_with_a_warning(tmp_path, caplog):
    chief_gfar, chief, path = _chief_file(tmp_path)
    chief_state = _snapshot(_state(chief_gfar))
    gfar, model = _worker_1()   # optimizer not built: load_weights_from_chief builds it
    with caplog.at_level(logging.WARNING, logger="gf_tf.keras"):
        backup.load_weights_from_chief(model, path)
    assert (f"gf_tf: worker 1 loaded the chief's {path}: its reducer state (CSC: residuals and momentum) starts from "
            f"zero (step counters follow the chief's).") in caplog.text
    for a, b in zip(chief.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations.numpy()) == 4
    restored = {}
    recorder = _Recorder(restored)
    gfar.state_registry.add_listener(recorder.record)
    gfar._workers = None   # pylint: disable=protected-access  # train in this one process
    x, y = _data()
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    assert restored["steps"] == chief_state["steps"] == [4, 4]
    for r in range(2):
        assert not np.any(restored["residuals"][r]) and not np.any(restored["velocities"][r])
    assert _snapshot(_state(gfar))["steps"] == [5, 5]


def test_checkpoint_without_csc_state_gives_a_warned_reset(tmp_path, caplog):
    _, model, _ = _trained(tmp_path, sparsity=False)
    path = str(tmp_path / "dense.weights.h5")
    model.save_weights(path)
    with caplog.at_level(logging.WARNING, logger="gf_tf.keras"):
        gfar = _load_into(path)
    assert "holds no reducer state" in caplog.text
    assert _snapshot(_state(gfar))["steps"] == [1, 1]


def test_csc_state_into_a_run_without_csc_is_ignored_with_a_warning(tmp_path, caplog):
    _, _, path = _trained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="gf_tf.keras"):
        _load_into(path, sparsity=False)
    assert ("holds the state of the reducer gf_tf.csc.reducer.CSCReducer but this "
            "GradientFlowAllReduce's reducer gf_tf.reducers.dense.DenseReducer keeps none: the "
            "state is ignored") in caplog.text


def test_plain_keras_model_loads_a_gf_tf_checkpoint(tmp_path):
    """Weights saved under GradientFlow load into a model without any strategy."""
    _, trained, path = _trained(tmp_path)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.load_weights(path)
    for a, b in zip(trained.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.at = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("simulated preemption")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_file_removed_by_another_worker_during_cleanup_is_no_failure(tmp_path, monkeypatch, rank):
    """At training's end the chief removes backup_dir while every other worker removes its own
    files in it: the first removal here finds a file gone (FileNotFoundError from the chief's
    walk, NotFoundError from gfile), the next attempt finishes, and training ends normally."""
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    (backup_dir / "gf_tf_state.worker1.npz").write_bytes(b"x")
    callback = backup.BackupAndRestore(str(backup_dir))
    monkeypatch.setattr(backup.BackupAndRestore, "_rank", lambda self: rank)
    failures = [FileNotFoundError("gone under the walk") if rank == 0 else
                tf.errors.NotFoundError(None, None, "gone")]
    original = (keras.callbacks.BackupAndRestore.on_train_end if rank == 0 else tf.io.gfile.remove)

    def first_fails(*args, **kwargs):
        if failures:
            raise failures.pop()
        return original(*args, **kwargs)

    if rank == 0:
        monkeypatch.setattr(keras.callbacks.BackupAndRestore, "on_train_end", first_fails)
    else:
        monkeypatch.setattr(tf.io.gfile, "remove", first_fails)
    callback.on_train_end()
    assert not failures
    assert not (backup_dir / "gf_tf_state.worker1.npz").exists()
    assert backup_dir.exists() == (rank == 1)   # the chief removes the directory


def test_backup_and_restore_resumes_csc_state(tmp_path):
    """gf_tf.keras.backup.BackupAndRestore on one worker: after a crash at the end of
    epoch 1 the restarted job restores the residuals, momentum and step counter
    and finishes with the weights of an uninterrupted run, bitwise."""
    x, y = _data()
    gfar_a, model_a = _setup()
    model_a.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    backup_dir = str(tmp_path / "backup")
    gfar_b, model_b = _setup()
    with pytest.raises(RuntimeError, match="simulated preemption"):
        model_b.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    callbacks=[backup.BackupAndRestore(backup_dir), _Interrupt(epoch=1)])
    saved = _snapshot(_state(gfar_b))   # the backup was written at the end of epoch 1
    assert saved["steps"] == [8, 8]

    gfar_c, model_c = _setup(seed=5)
    restored = {}
    recorder = _Recorder(restored)
    model_c.optimizer.build(model_c.trainable_variables)   # attaches the checkpoint's listener
    gfar_c.state_registry.add_listener(recorder.record)
    history = model_c.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                          callbacks=[backup.BackupAndRestore(backup_dir),
                                     gf_tf.GradientFlowStats(gfar_c)])
    assert history.epoch == [2]
    assert restored["steps"] == [8, 8]
    for r in range(2):
        np.testing.assert_array_equal(restored["residuals"][r], saved["residuals"][r])
        np.testing.assert_array_equal(restored["velocities"][r], saved["velocities"][r])
    # No second warm-up: the 4 steps of epoch 3 are sparse (3 of 25 chunks each).
    assert history.history["gf_selected_chunks_per_step"] == [3]
    for a, c in zip(model_a.get_weights(), model_c.get_weights()):
        np.testing.assert_array_equal(a, c)
    # The CommStats totals came back with the backup: figures over all steps cover the whole
    # run (12 steps: 2 dense, 10 sparse), as the uninterrupted run's, not the resumed epoch's.
    assert gfar_c.stats.totals() == gfar_a.stats.totals()
    assert gfar_c.stats.totals()["steps"] == 12
    assert gfar_c.stats.result() == gfar_a.stats.result()


class _Recorder:
    """A state listener registered after the checkpoint's: sees the state as restored."""

    def __init__(self, out):
        self.out = out

    def record(self, state):
        self.out.update(_snapshot(state.pack_states[0]))


def test_tf_train_checkpoint_of_model_and_optimizer_holds_the_csc_state(tmp_path):
    """tf.train.Checkpoint(model=..., optimizer=...): save after one epoch, restore into a fresh
    model before its first step, train on: bitwise the uninterrupted run."""
    x, y = _data()
    gfar_a, model_a = _setup()
    model_a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    gfar_b, model_b = _setup()
    model_b.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    saved = _snapshot(_state(gfar_b))
    path = tf.train.Checkpoint(model=model_b, optimizer=model_b.optimizer).write(
        str(tmp_path / "ckpt"))

    gfar_c, model_c = _setup(seed=7)
    model_c.optimizer.build(model_c.trainable_variables)
    tf.train.Checkpoint(model=model_c, optimizer=model_c.optimizer).read(path).assert_consumed()
    model_c.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert saved["steps"] == [4, 4] and _snapshot(_state(gfar_c))["steps"] == [8, 8]
    for a, c in zip(model_a.get_weights(), model_c.get_weights()):
        np.testing.assert_array_equal(a, c)
    a, c = _snapshot(_state(gfar_a)), _snapshot(_state(gfar_c))
    for r in range(2):
        np.testing.assert_array_equal(a["residuals"][r], c["residuals"][r])
