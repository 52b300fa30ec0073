"""Keras model.fit on 2 worker processes (127.0.0.1, TF_CONFIG) with gf_tf.MultiWorkerMirroredStrategy.

Each run starts real workers through tests/cluster.py (free ports, collective
timeout, hard timeout); the worker script is tests/workers/fit_worker.py.
"""

import numpy as np
import pytest

import cluster
from gf_tf.wire import ahead_slots
from helpers import fp16_pack_bytes

# slow: every test starts 2 worker processes (tests/workers/fit_worker.py).
pytestmark = pytest.mark.slow

TIMEOUT = 150        # hard limit per run, seconds
COMM_TIMEOUT = 30    # CommunicationOptions(timeout_seconds=...)
MODEL_ELEMENTS = 8 * 32 + 32 + 32 * 3 + 3   # the fit worker's Dense(32) -> Dense(3)


def run_fit(*args, **kwargs):
    results = cluster.run_workers("fit_worker.py", 2, args, timeout=TIMEOUT,
                                  comm_timeout=COMM_TIMEOUT, **kwargs)
    assert all(r.ok for r in results), cluster.describe(results)
    return results


def weights(result):
    return [result[k] for k in sorted((k for k in result if k[0] == "w" and k[1:].isdigit()),
                                      key=lambda k: int(k[1:]))]


@pytest.fixture(scope="module")
def baseline():
    """The same fit in one process without any strategy, float32 (the reference)."""
    r = cluster.run_process("fit_worker.py", ["--baseline"], timeout=TIMEOUT)
    assert r.ok, cluster.describe([r])
    return r.result


def assert_identical_across_workers(results):
    for a, b in zip(weights(results[0].result), weights(results[1].result)):
        assert a.tobytes() == b.tobytes(), "workers ended with different weights"


def test_fit_fp16_two_workers_identical_and_close_to_float32_baseline(baseline):
    results = run_fit("--compression", "fp16", "--bytes_per_pack", "1024")
    assert_identical_across_workers(results)
    w = weights(results[0].result)
    for got, want in zip(w, weights(baseline)):
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        assert np.any(got != want), "FP16 path left no trace: did it run?"
    # The traced step's gradient collective is float16, all 387 gradient elements in one
    # pack with its slots (the 4 tensors' bounds scaled a step ahead, wire.ahead_slots): about
    # half the 1548 bytes float32 would have sent; its float32 retry (387 + 4) is taken at the
    # first step (gf_tf.reducers.dense).
    r = results[0].result
    grad_reduces = [(d, n) for d, n in zip(r["reduce_dtypes"], r["reduce_elements"])
                    if n == MODEL_ELEMENTS + ahead_slots(4)]
    assert grad_reduces and all(d == "float16" for d, _ in grad_reduces), r["reduce_dtypes"]
    float32_vectors = [n for d, n in zip(r["reduce_dtypes"], r["reduce_elements"])
                       if d == "float32" and n > 1]
    assert float32_vectors == [MODEL_ELEMENTS + 4] * len(grad_reduces), float32_vectors
    retries = float(r["retries_per_step"])
    assert 0.25 <= retries < 1   # 4 steps: the first and at most two more
    assert float(r["sent_bytes_per_step"]) == fp16_pack_bytes(MODEL_ELEMENTS, 4, retries)
    assert float(r["dense_bytes_per_step"]) == 4 * MODEL_ELEMENTS
    assert int(r["stat_steps"]) == 4
    # evaluate and predict work too (Keras's multi-worker predict gathers through our ops).
    np.testing.assert_allclose(r["evaluate_loss"], baseline["evaluate_loss"], rtol=1e-3)
    assert r["predict"].shape == baseline["predict"].shape
    np.testing.assert_allclose(np.sort(r["predict"], axis=0), np.sort(baseline["predict"], axis=0),
                               atol=2e-3)


def test_fit_without_gradient_flow_works_and_matches_baseline(baseline):
    """The Keras multi-worker fixes alone (gradient_flow=None): TF's own float32 all-reduce."""
    results = run_fit("--gradient_flow", "off", "--check_steps_per_execution")
    assert_identical_across_workers(results)
    for got, want in zip(weights(results[0].result), weights(baseline)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(results[0].result["loss"], baseline["loss"], rtol=1e-5)
    r = results[0].result
    assert ("float32", MODEL_ELEMENTS) in zip(r["reduce_dtypes"], r["reduce_elements"])
    # steps_per_execution > 1 trains too (stock Keras fails with an unfed placeholder);
    # tests/test_multistep.py checks its results.
    for worker in results:
        assert str(worker.result["steps_per_execution_error"]) == ""


def test_mismatched_settings_fail_fast_naming_setting_and_workers():
    results = cluster.run_workers(
        "fit_worker.py", 2, [], timeout=TIMEOUT, comm_timeout=COMM_TIMEOUT,
        per_worker_args=[["--compression", "fp16"],
                         ["--compression", "none", "--bytes_per_pack", "2048",
                          "--freeze_first_layer"]])
    for r in results:
        assert r.returncode not in (0, None), cluster.describe(results)
        assert "settings differ across workers" in r.output, cluster.describe(results)
        assert "compression: worker 0 = 'fp16', worker 1 = None" in r.output
        assert "bytes_per_pack: worker 0 = 1024, worker 1 = 2048" in r.output
        assert "number of gradients: worker 0 = 4, worker 1 = 2" in r.output
        assert "InternalError" not in r.output
        assert r.seconds < TIMEOUT


@pytest.mark.parametrize("worker_args, mismatch", [
    ([["--reducer", "lowrank", "--rank", "2"], ["--reducer", "lowrank", "--rank", "1"]],
     "low-rank rank: worker 0 = 2, worker 1 = 1"),
    ([["--reducer", "lowrank"], []], "reducer: worker 0 = LowRank, worker 1 = DenseReducer"),
    ([["--reducer", "lowrank", "--warmup_steps", "5"], ["--reducer", "lowrank"]],
     "low-rank warmup_steps: worker 0 = 5, worker 1 = 0"),
    # Rank 4 compresses none of the model's matrices (8x32 takes rank 1 to 3): worker 1's
    # reducer refuses the set, and worker 0 hears the mismatch, not only that its peer stopped.
    ([["--reducer", "lowrank", "--rank", "2"], ["--reducer", "lowrank", "--rank", "4"]],
     "low-rank rank: worker 0 = 2, worker 1 = 4"),
])
def test_a_worker_with_another_reducer_or_rank_fails_fast_naming_it(worker_args, mismatch):
    results = cluster.run_workers("fit_worker.py", 2, [], timeout=TIMEOUT,
                                  comm_timeout=COMM_TIMEOUT, per_worker_args=worker_args)
    for r in results:
        assert r.returncode not in (0, None), cluster.describe(results)
        assert "settings differ across workers" in r.output, cluster.describe(results)
        assert mismatch in r.output, cluster.describe(results)
        assert "InternalError" not in r.output
        assert r.seconds < TIMEOUT


def test_mixed_float16_with_loss_scale_optimizer_two_workers():
    results = run_fit("--mixed_precision")
    assert_identical_across_workers(results)
    r = results[0].result
    assert str(r["optimizer"]) == "LossScaleOptimizer"
    assert all(np.all(np.isfinite(w)) for w in weights(r))
    assert np.all(np.isfinite(r["loss"]))
    assert ("float16", MODEL_ELEMENTS + ahead_slots(4)) in zip(r["reduce_dtypes"], r["reduce_elements"])


def test_an_inf_on_worker_1_alone_is_skipped_by_both_workers_and_halves_the_loss_scale_once():
    """Every worker takes the same finite/non-finite branch (gf_tf.keras), so none hangs."""
    results = run_fit("--mixed_precision", "--inf_on_worker", "1", "--inf_step", "1")
    assert_identical_across_workers(results)
    for r in results:
        assert all(np.all(np.isfinite(w)) for w in weights(r.result))
        assert float(r.result["loss_scale"]) == 2.0 ** 15 / 2   # Keras's initial scale, halved once
        assert int(r.result["applied_steps"]) == 4 - 1          # the step with the inf was skipped
