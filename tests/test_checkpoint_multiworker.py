"""Preemption with CSC: 2 workers, one SIGKILLed after an epoch, resumed by BackupAndRestore.

Real worker processes (tests/cluster.py, TF_CONFIG on 127.0.0.1), real
collectives, Keras fit with gf_tf.ChunkSparsity (momentum correction, warm-up)
and gf_tf.keras.backup.BackupAndRestore, TF op determinism on.
"""

import os

import numpy as np
import pytest

from tests import cluster

# slow: every test starts 2 worker processes (tests/workers/resume_worker.py).
pytestmark = pytest.mark.slow

SCRIPT = "resume_worker.py"


def _run(tmp_path, name, kill_after_epoch=-1, comm_timeout=60.0, selection="per_pack",
         reducer="csc"):
    backup, states = tmp_path / name / "backup", tmp_path / name / "states"
    os.makedirs(states, exist_ok=True)
    args = ["--backup_dir", str(backup), "--state_dir", str(states), "--epochs", "4",
            "--kill_after_epoch", str(kill_after_epoch), "--selection", selection,
            "--reducer", reducer]
    return cluster.run_workers(SCRIPT, 2, args=args, timeout=300.0, comm_timeout=comm_timeout), \
        backup, states


@pytest.mark.parametrize("selection", ["per_pack", "ahead"])
def test_sigkill_then_backup_and_restore_matches_an_uninterrupted_run_bitwise(tmp_path, selection):
    """With selection="ahead" the chunks of the first resumed step were chosen before the kill: they
    come back with the scores and bound, so the resumed run sends what the uninterrupted one did."""
    reference, _, _ = _run(tmp_path, "reference", selection=selection)
    assert all(r.ok for r in reference), cluster.describe(reference)

    killed, backup, states = _run(tmp_path, "job", kill_after_epoch=1, comm_timeout=20.0, selection=selection)
    assert killed[1].returncode == -9, cluster.describe(killed)
    assert killed[0].returncode not in (0, None), cluster.describe(killed)   # its peer vanished
    assert sorted(os.listdir(backup)) == ["gf_tf_state.worker1.npz", "latest.weights.h5",
                                          "training_metadata.json"]

    resumed, _, _ = _run(tmp_path, "job", selection=selection)
    assert all(r.ok for r in resumed), cluster.describe(resumed)
    for worker in range(2):
        before = np.load(states / f"epoch1_worker{worker}.npz")
        after = resumed[worker].result
        np.testing.assert_array_equal(after["epochs_run"], [2, 3])
        np.testing.assert_array_equal(after["restored_steps"], before["steps"])
        assert int(before["steps"][0]) == 8
        np.testing.assert_array_equal(after["restored_residual"], before["residual"])
        np.testing.assert_array_equal(after["restored_velocity"], before["velocity"])
        if selection == "ahead":
            np.testing.assert_array_equal(after["restored_scores"], before["scores"])
            np.testing.assert_array_equal(after["restored_bound"], before["bound"])
            assert np.any(before["scores"]) and float(before["bound"]) > 0
        assert np.any(before["residual"])
        # No second warm-up: every resumed step sends 3 of the 25 chunks (387 parameters,
        # chunks of 16, density 0.1).
        np.testing.assert_array_equal(after["selected_chunks"], [3, 3])
        for i in range(4):
            np.testing.assert_array_equal(after[f"w{i}"], reference[worker].result[f"w{i}"])
        # CommStats came back with the backup: the totals cover all 16 steps of the run, as the
        # uninterrupted run's do (not only the resumed epochs', which flatter the compression).
        for key in ("steps", "dense_bytes", "sent_bytes", "selected_chunks", "total_chunks",
                    "residual_norm", "densities"):
            np.testing.assert_array_equal(after[f"comm_{key}"], reference[worker].result[f"comm_{key}"])
        assert int(after["comm_steps"]) == 16
    # Residuals are per worker: the two workers' saved residuals differ.
    r0 = np.load(states / "epoch1_worker0.npz")["residual"]
    r1 = np.load(states / "epoch1_worker1.npz")["residual"]
    assert not np.array_equal(r0, r1)


def test_sigkill_then_backup_and_restore_gives_back_low_rank_state_and_weights_bitwise(tmp_path):
    """gf_tf.reducers.LowRank(rank=2) on the FP16 wire (the 8x32 kernel compressed, the rest
    dense): worker 1 SIGKILLed after epoch 1; the relaunched job restores every worker's Q and
    residual as they were at the kill and ends with the uninterrupted run's weights, Q's,
    residuals and CommStats totals, bitwise."""
    reference, _, _ = _run(tmp_path, "reference", reducer="lowrank")
    assert all(r.ok for r in reference), cluster.describe(reference)

    killed, backup, states = _run(tmp_path, "job", kill_after_epoch=1, comm_timeout=20.0,
                                  reducer="lowrank")
    assert killed[1].returncode == -9, cluster.describe(killed)
    assert killed[0].returncode not in (0, None), cluster.describe(killed)   # its peer vanished
    assert "gf_tf_state.worker1.npz" in os.listdir(backup)

    resumed, _, _ = _run(tmp_path, "job", reducer="lowrank")
    assert all(r.ok for r in resumed), cluster.describe(resumed)
    saved = [dict(np.load(states / f"epoch1_worker{worker}.npz")) for worker in range(2)]
    assert sorted(saved[0]) == ["p0_q0_r0", "p0_residual_r0", "step_r0"]
    assert saved[0]["p0_q0_r0"].shape == (32, 2) and saved[0]["p0_residual_r0"].shape == (8 * 32,)
    # Q is the all-reduced factor, the same on every worker; the residuals are each worker's own.
    assert saved[0]["p0_q0_r0"].tobytes() == saved[1]["p0_q0_r0"].tobytes()
    assert np.any(saved[0]["p0_residual_r0"])
    assert not np.array_equal(saved[0]["p0_residual_r0"], saved[1]["p0_residual_r0"])
    assert int(saved[0]["step_r0"]) == int(saved[1]["step_r0"]) == 8   # 2 epochs of 4 steps
    for worker in range(2):
        after, uninterrupted = resumed[worker].result, reference[worker].result
        np.testing.assert_array_equal(after["epochs_run"], [2, 3])
        for key, value in saved[worker].items():
            np.testing.assert_array_equal(after[f"restored_{key}"], value, err_msg=key)
            np.testing.assert_array_equal(after[f"final_{key}"], uninterrupted[f"final_{key}"],
                                          err_msg=key)
        for i in range(4):
            np.testing.assert_array_equal(after[f"w{i}"], uninterrupted[f"w{i}"])
        for key in (k for k in uninterrupted if k.startswith("comm_")):
            np.testing.assert_array_equal(after[key], uninterrupted[key], err_msg=key)
        assert int(after["comm_steps"]) == 16


def test_every_worker_loads_the_chiefs_file_with_load_weights_from_chief(tmp_path):
    """TF's multi-worker guide: only the chief saves, every worker loads the chief's file. Plain
    load_weights refuses it on worker 1 and names the recipe; load_weights_from_chief gives every
    worker the chief's weights, worker 1 zero residuals (warned) and the chief's step counters."""
    results = cluster.run_workers("chief_file_worker.py", 2, args=["--dir", str(tmp_path)],
                                  timeout=300.0, comm_timeout=60.0)
    assert all(r.ok for r in results), cluster.describe(results)
    chief, other = (r.result for r in results)
    assert str(chief["plain_error"]) == "" and str(chief["warnings"]) == ""
    assert str(other["plain_error"]).startswith(
        "gf_tf: cannot restore the checkpoint's reducer state: it holds worker 0's state and this is "
        "worker 1. Each worker must load the file it saved itself (or use "
        "gf_tf.keras.backup.BackupAndRestore); to load a file only the chief saved"), other["plain_error"]
    assert "gf_tf.keras.backup.load_weights_from_chief(model, path)" in str(other["plain_error"])
    assert str(other["warnings"]) == (
        f"gf_tf: worker 1 loaded the chief's {tmp_path / 'chief.weights.h5'}: its reducer state (CSC: "
        f"residuals and momentum) starts from zero (step counters follow the chief's).")
    for i in range(4):
        np.testing.assert_array_equal(other[f"loaded{i}"], chief[f"saved{i}"])
        np.testing.assert_array_equal(chief[f"loaded{i}"], chief[f"saved{i}"])
        np.testing.assert_array_equal(other[f"final{i}"], chief[f"final{i}"])   # in sync after
    # 4 steps saved: the chief resumes its own residual, worker 1 starts from zero; both count on.
    for worker in (chief, other):
        np.testing.assert_array_equal(worker["restored_steps"], chief["first_steps"])
        np.testing.assert_array_equal(worker["final_steps"], [8])
    assert int(chief["first_steps"][0]) == 4
    np.testing.assert_array_equal(chief["restored_residual"], chief["first_residual"])
    assert np.any(other["first_residual"]) and not np.any(other["restored_residual"])
    assert not np.any(other["restored_velocity"])


def test_sigkill_then_backup_and_restore_gives_back_the_auto_regime_bitwise(tmp_path):
    """density="auto" (worker_util.checkpoint_strategy "csc_auto": the fake clock makes the price
    pick the floor on every step, so the rungs follow the critical-regime test alone): worker 1
    SIGKILLed after epoch 1; the relaunched job restores the regime (float64 [4]), the residuals,
    velocities and step counters of both workers bit for bit, and continues as the uninterrupted
    run did: the same densities, weights and CommStats. A regime that came back critical would
    send its first resumed steps dense and end elsewhere."""
    reference, _, _ = _run(tmp_path, "reference", reducer="csc_auto")
    assert all(r.ok for r in reference), cluster.describe(reference)
    # Epoch means: steps 0-2 dense (critical until two windows agree), then the floor. A regime
    # restored critical would make the resumed epoch 2 dense again.
    np.testing.assert_allclose(reference[0].result["densities"],
                               [(3 * 1.0 + 0.01) / 4, 0.01, 0.01, 0.01], rtol=1e-12)

    killed, backup, states = _run(tmp_path, "job", kill_after_epoch=1, comm_timeout=20.0,
                                  reducer="csc_auto")
    assert killed[1].returncode == -9, cluster.describe(killed)
    resumed, _, _ = _run(tmp_path, "job", reducer="csc_auto")
    assert all(r.ok for r in resumed), cluster.describe(resumed)
    saved = [dict(np.load(states / f"epoch1_worker{worker}.npz")) for worker in range(2)]
    # The regime is all-reduced figures: the same on both workers, and measured (not the start).
    assert saved[0]["regime"].tobytes() == saved[1]["regime"].tobytes()
    assert saved[0]["regime"][2] > 0.0
    for worker in range(2):
        after, uninterrupted = resumed[worker].result, reference[worker].result
        np.testing.assert_array_equal(after["epochs_run"], [2, 3])
        for key, value in saved[worker].items():
            assert after[f"restored_{key}"].tobytes() == value.tobytes(), key
            np.testing.assert_array_equal(after[f"final_{key}"], uninterrupted[f"final_{key}"],
                                          err_msg=key)
        np.testing.assert_array_equal(after["densities"], uninterrupted["densities"][2:])
        for i in range(4):
            np.testing.assert_array_equal(after[f"w{i}"], uninterrupted[f"w{i}"])
        for key in (k for k in uninterrupted if k.startswith("comm_")):
            np.testing.assert_array_equal(after[key], uninterrupted[key], err_msg=key)
