"""gf_tf.keras.LocalSGD on 2 worker processes (127.0.0.1, TF_CONFIG): the workers' weights differ
between meetings and are bitwise equal after each (tests/workers/local_sgd_worker.py)."""

import numpy as np
import pytest

import cluster
from helpers import fp16_pack_bytes

pytestmark = pytest.mark.slow   # starts 2 worker processes

MODEL_ELEMENTS = 8 * 16 + 16 + 16 * 3 + 3


def start(*args, comm_timeout=30):
    return cluster.run_workers("local_sgd_worker.py", 2, args, timeout=180, comm_timeout=comm_timeout)


def run(*args):
    results = start(*args)
    assert all(r.ok for r in results), cluster.describe(results)
    return [r.result for r in results]


@pytest.mark.parametrize("args", [(), ("--mixed_precision",)])
def test_workers_differ_between_meetings_and_are_bitwise_equal_after(args):
    first, second = run("--sync_every", "3", "--outer", "nesterov", "--steps", "6", *args)
    equal = [a.tobytes() == b.tobytes() for a, b in zip(first["after_step"], second["after_step"])]
    assert equal == [False, False, True, False, False, True]
    assert int(first["meetings"]) == 2 and int(first["applied_steps"]) == 6
    assert first["evaluate_loss"] == second["evaluate_loss"]
    # 6 local steps send nothing; each meeting one float16 pack with its slots, the FP16
    # wire scaled a step ahead, and the first meeting its float32 retry (gf_tf.reducers.dense).
    assert float(first["stat_steps"]) == 6   # meetings add bytes, not steps
    retries = float(first["retries"])
    assert 1 <= retries <= 2
    assert float(first["sent_bytes"]) == 2 * fp16_pack_bytes(MODEL_ELEMENTS, 4, retries / 2)


def test_sigkill_then_backup_and_restore_matches_an_uninterrupted_run_bitwise(tmp_path):
    """DiLoCo with H = 3 over 3 epochs of 4 steps, inner SGD with momentum 0.9; worker 1 SIGKILLed
    after epoch 1; the relaunched job (LocalSGD listed before BackupAndRestore) restores the
    weights, the optimizer's step count, the outer Nesterov momentum and each worker's own inner
    momentum (it differs between workers), and ends with the uninterrupted run's weights and
    momenta, bitwise."""
    settings = ("--sync_every", "3", "--outer", "nesterov", "--steps", "4", "--epochs", "3",
                "--momentum", "0.9")
    reference = run(*settings, "--backup_dir", str(tmp_path / "reference"))
    job = ("--backup_dir", str(tmp_path / "job"))
    killed = start(*settings, *job, "--kill_after_epoch", "1", comm_timeout=20)
    assert killed[1].returncode == -9, cluster.describe(killed)
    resumed = run(*settings, *job)
    for worker in range(2):
        want, got = reference[worker], resumed[worker]
        assert int(got["applied_steps"]) == 12 and len(got["after_step"]) == 4   # epoch 2 only
        keys = [k for k in want if k[0] in "woi" and k[-1].isdigit()]
        assert len([k for k in keys if k.startswith("outer")]) >= 3   # iterations, lr, momentum
        assert len([k for k in keys if k.startswith("inner")]) == 1 + 4   # lr, 4 momenta
        for key in keys:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert any(a.tobytes() != b.tobytes() for a, b in
               zip(*[[r[k] for k in sorted(r) if k.startswith("inner")] for r in reference]))
