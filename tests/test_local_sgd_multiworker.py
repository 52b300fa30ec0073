"""gf_tf.keras.LocalSGD on 2 worker processes (127.0.0.1, TF_CONFIG): the workers' weights differ
between meetings and are bitwise equal after each (tests/workers/local_sgd_worker.py)."""

import pytest

import cluster

pytestmark = pytest.mark.slow   # starts 2 worker processes

MODEL_ELEMENTS = 8 * 16 + 16 + 16 * 3 + 3


def run(*args):
    results = cluster.run_workers("local_sgd_worker.py", 2, args, timeout=120, comm_timeout=30)
    assert all(r.ok for r in results), cluster.describe(results)
    return [r.result for r in results]


@pytest.mark.parametrize("args", [(), ("--mixed_precision",)])
def test_workers_differ_between_meetings_and_are_bitwise_equal_after(args):
    first, second = run("--sync_every", "3", "--outer", "nesterov", "--steps", "6", *args)
    equal = [a.tobytes() == b.tobytes() for a, b in zip(first["after_step"], second["after_step"])]
    assert equal == [False, False, True, False, False, True]
    assert int(first["meetings"]) == 2 and int(first["applied_steps"]) == 6
    assert first["evaluate_loss"] == second["evaluate_loss"]
    # 6 local steps send nothing; each meeting one float16 pack and its float32 scale bounds
    # (one per tensor): the FP16 wire with its power-of-two scaling.
    assert float(first["stat_steps"]) == 6 + 2
    assert float(first["sent_bytes"]) == 2 * (2 * MODEL_ELEMENTS + 4 * 4)
