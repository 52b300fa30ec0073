"""Keras's multi-step loop (`steps_per_execution > 1`) trains correctly under MirroredStrategy
with GradientFlowAllReduce and under gf_tf.MultiWorkerMirroredStrategy (stock TF + Keras 3.15
fail there; tf-keras works as it is), and Keras 3's `gradient_accumulation_steps > 1` fails at
fit with an error naming the fix. Runs with the cell's Keras flavour (multistep_worker.py).
"""

import numpy as np
import pytest

from cluster import describe, run_process, run_workers

from gf_tf import keras_compat

pytestmark = pytest.mark.slow

EPOCHS, EXAMPLES, BATCH = 2, 112, 16


def _mirrored(*args):
    r = run_process("multistep_worker.py", [f"--epochs={EPOCHS}", f"--examples={EXAMPLES}", *args],
                    timeout=180)
    assert r.ok and r.result is not None, describe([r])
    return r.result


def _sgd_reference(result):
    """Float64 NumPy SGD (lr 0.1) on Keras's MSE: mean over outputs, then over the global batch."""
    x, y = result["x"].astype(np.float64), result["y"].astype(np.float64)
    w, b = result["w0_init"].astype(np.float64), result["w1_init"].astype(np.float64)
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            err = xb @ w + b - yb
            scale = 2.0 / (len(xb) * yb.shape[1])
            w, b = w - 0.1 * scale * xb.T @ err, b - 0.1 * scale * err.sum(0)
    return w, b


@pytest.mark.parametrize("steps_per_execution", [3, 7])
def test_mirrored_multi_step_fit_matches_float64_sgd(steps_per_execution):
    r = _mirrored(f"--steps_per_execution={steps_per_execution}", "--compression=none")
    assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
    w, b = _sgd_reference(r)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


def test_mirrored_fp16_csc_multi_step_equals_single_step():
    """Same packs, same CSC schedule: the multi-step loop gives bit-identical weights, and the
    CSC step counter advanced once per training step (warm-up and top-k stayed in step)."""
    one = _mirrored("--steps_per_execution=1", "--compression=fp16", "--density=0.25")
    three = _mirrored("--steps_per_execution=3", "--compression=fp16", "--density=0.25")
    steps = EPOCHS * EXAMPLES // BATCH
    for r in (one, three):
        assert int(r["iterations"]) == steps == int(r["csc_step"]) == int(r["gf_steps"])
    assert not np.array_equal(one["w0"], one["w0_init"])
    for k in ("w0", "w1"):
        np.testing.assert_array_equal(three[k], one[k], err_msg=k)


@pytest.mark.skipif(not keras_compat.uses_tf_keras(), reason="tf-keras's legacy optimizers")
def test_tf_keras_legacy_optimizer_gradients_go_through_gradient_flow():
    """OptimizerV2 aggregates through its own hook (`_aggregate_gradients`)."""
    r = _mirrored("--steps_per_execution=2", "--compression=none", "--legacy_optimizer")
    assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
    w, b = _sgd_reference(r)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


@pytest.mark.skipif(keras_compat.uses_tf_keras(), reason="tf-keras optimizers do not accumulate")
def test_gradient_accumulation_fails_at_fit_naming_the_option_and_the_fix():
    r = _mirrored("--accumulation=2")
    message = str(r["error"])
    assert "gradient_accumulation_steps=2 does not work under MirroredStrategy" in message
    assert "global batch 2x larger" in message


def _workers(*args):
    results = run_workers("multistep_worker.py", num_workers=2, timeout=180, comm_timeout=60,
                          args=[f"--epochs={EPOCHS}", f"--examples={EXAMPLES}", *args])
    assert all(r.ok and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


def test_multi_worker_multi_step_fit_matches_single_step_and_float64_sgd():
    one = _workers("--steps_per_execution=1", "--compression=fp16", "--density=0.25")
    three = _workers("--steps_per_execution=3", "--compression=fp16", "--density=0.25")
    for k in ("w0", "w1"):
        np.testing.assert_array_equal(one[0][k], one[1][k], err_msg=k)
        np.testing.assert_array_equal(three[0][k], three[1][k], err_msg=k)
        np.testing.assert_array_equal(three[0][k], one[0][k], err_msg=k)
    dense = _workers("--steps_per_execution=4", "--compression=none")
    w, b = _sgd_reference(dense[0])
    for r in dense + one + three:
        assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
    for r in dense:
        np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
        np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)
