"""Keras's multi-step loop (`steps_per_execution > 1`) trains correctly under MirroredStrategy
with GradientFlowAllReduce and under gf_tf.MultiWorkerMirroredStrategy (stock TF + Keras 3.15
fail there; tf-keras works as it is), and Keras 3's `gradient_accumulation_steps > 1` trains there
under a GradientFlowAllReduce (stock fails) with Keras's accumulation semantics, and fails at fit with
an error naming the fix under TF's own all-reduce. The reducers' state (CSC's, and the low-rank
reducer's Q's and residuals, checked against lowrank_reference.Model) advances once per applied update.
Runs with the cell's Keras flavour (multistep_worker.py).
"""

import numpy as np
import pytest
import tensorflow as tf

from cluster import describe, run_process, run_workers

import gf_tf
from gf_tf.keras import flavour
from gf_tf.reducers import LowRank
from csc_reference import NumpyCSC
from helpers import GRADIENT_SCALE
from lowrank_reference import Model

pytestmark = pytest.mark.slow

EPOCHS, EXAMPLES, BATCH = 2, 112, 16


def _mirrored(*args):
    r = run_process("multistep_worker.py", [f"--epochs={EPOCHS}", f"--examples={EXAMPLES}", *args],
                    timeout=180)
    assert r.ok and r.result is not None, describe([r])
    return r.result


def _sgd_reference(result):
    """Float64 NumPy SGD (lr 0.1) on Keras's MSE: mean over outputs, then over the global batch
    (times GRADIENT_SCALE)."""
    x, y = result["x"].astype(np.float64), result["y"].astype(np.float64)
    w, b = result["w0_init"].astype(np.float64), result["w1_init"].astype(np.float64)
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            err = xb @ w + b - yb
            scale = GRADIENT_SCALE * 2.0 / (len(xb) * yb.shape[1])
            w, b = w - 0.1 * scale * xb.T @ err, b - 0.1 * scale * err.sum(0)
    return w, b


@pytest.mark.parametrize("steps_per_execution, unknown_length", [(3, False), (7, False), (1, True), (3, True)])
def test_mirrored_multi_step_fit_matches_float64_sgd(steps_per_execution, unknown_length):
    """14 steps, each counted once: also where an epoch's last call runs out of data (7 batches in
    calls of 3; data of unknown length, whose end Keras finds by reading past it), where Keras 3.6
    (3 and unknown length) and 3.7-3.15 (1 and unknown length) count 16, tf-keras 15 (1 and unknown
    length; gf_tf.keras.multi_step). tf-keras refuses data of unknown length in calls of 3."""
    r = _mirrored(f"--steps_per_execution={steps_per_execution}", "--compression=none",
                  *(["--unknown_length"] if unknown_length else []))
    if flavour.uses_tf_keras() and unknown_length and steps_per_execution > 1:
        # tf-keras's own refusal (data_adapter), which gf_tf leaves as it is.
        assert "Could not infer the size of the data" in str(r["error"]), r
        return
    assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
    w, b = _sgd_reference(r)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("reducer", [["--density=0.25"], ["--rank=1"]], ids=["csc", "lowrank"])
def test_mirrored_fp16_multi_step_equals_single_step(reducer):
    """Same packs, same reducer state: the multi-step loop gives bit-identical weights. CSC's step
    counter advanced once per training step (warm-up and top-k stayed in step); the low-rank
    reducer (rank 1: the 8x3 kernel compressed, the bias dense) ends with bit-identical Q's and
    residuals."""
    one = _mirrored("--steps_per_execution=1", "--compression=fp16", *reducer)
    three = _mirrored("--steps_per_execution=3", "--compression=fp16", *reducer)
    steps = EPOCHS * EXAMPLES // BATCH
    for r in (one, three):
        assert int(r["iterations"]) == steps == int(r["gf_steps"])
        assert int(r["csc_step"]) == (steps if "--density=0.25" in reducer else -1)
    assert not np.array_equal(one["w0"], one["w0_init"])
    state = [k for k in one if k.startswith(("residual_r", "q_r"))]
    assert len(state) == (4 if "--rank=1" in reducer else 2)
    for k in ("w0", "w1", *state):
        np.testing.assert_array_equal(three[k], one[k], err_msg=k)


@pytest.mark.skipif(not flavour.uses_tf_keras(), reason="tf-keras's legacy optimizers")
def test_tf_keras_legacy_optimizer_gradients_go_through_gradient_flow():
    """OptimizerV2 aggregates through its own hook (`_aggregate_gradients`)."""
    r = _mirrored("--steps_per_execution=2", "--compression=none", "--legacy_optimizer")
    assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
    w, b = _sgd_reference(r)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


_NO_ACCUMULATION = pytest.mark.skipif(flavour.uses_tf_keras(),
                                      reason="tf-keras optimizers do not accumulate")


@_NO_ACCUMULATION
def test_gradient_accumulation_under_stock_all_reduce_fails_at_fit_naming_the_option_and_the_fix():
    r = _mirrored("--accumulation=2", "--stock_all_reduce")
    message = str(r["error"])
    assert "gradient_accumulation_steps=2 does not work under MirroredStrategy" in message
    assert "global batch 2x larger" in message


def _accumulation_reference(result, k, csc=None, density=None):
    """Float64 NumPy of Keras 3.15's accumulation (`BaseOptimizer._backend_apply_gradients`) on
    2 replicas, each taking its consecutive half of every global batch of 16, with SGD (lr 0.1).

    Each replica's gradient of Keras's MSE (loss divided by the global batch; times GRADIENT_SCALE) is added to its own
    accumulator on every micro-step, across epochs; every k-th micro-step each replica sends
    (accumulator + g) / k, the all-reduce sums them (`csc`, a NumpyCSC of the pack in backprop
    order [b, w], selects the chunks instead when given) and SGD applies the sum.
    Returns (w, b, residuals [2, n] or None).
    """
    x, y = result["x"].astype(np.float64), result["y"].astype(np.float64)
    w, b = result["w0_init"].astype(np.float64), result["w1_init"].astype(np.float64)
    acc = np.zeros([2, b.size + w.size])
    micro = 0
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, BATCH):
            for r in range(2):
                xr = x[start + r * BATCH // 2:start + (r + 1) * BATCH // 2]
                yr = y[start + r * BATCH // 2:start + (r + 1) * BATCH // 2]
                err = (xr @ w + b - yr) * GRADIENT_SCALE * 2.0 / (BATCH * yr.shape[1])
                acc[r] += np.concatenate([err.sum(0), (xr.T @ err).ravel()])
            micro += 1
            if micro % k == 0:
                sent = acc / k
                total = sent.sum(0) if csc is None else csc.step(sent, density)[0]
                b, w = b - 0.1 * total[:b.size], w - 0.1 * total[b.size:].reshape(w.shape)
                acc[:] = 0.0
    return w, b, None if csc is None else csc.residual


def _assert_accumulated(r, k):
    micro_steps = EPOCHS * EXAMPLES // BATCH
    assert int(r["micro_steps"]) == micro_steps
    assert int(r["iterations"]) == int(r["gf_steps"]) == micro_steps // k   # one all-reduce per update
    assert not np.array_equal(r["w0"], r["w0_init"])


@_NO_ACCUMULATION
@pytest.mark.parametrize("k, steps_per_execution", [(2, 1), (3, 1), (2, 3)])
def test_mirrored_gradient_accumulation_matches_float64_keras_semantics(k, steps_per_execution):
    r = _mirrored(f"--accumulation={k}", "--compression=none",
                  f"--steps_per_execution={steps_per_execution}")
    _assert_accumulated(r, k)
    w, b, _ = _accumulation_reference(r, k)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


@_NO_ACCUMULATION
def test_mirrored_gradient_accumulation_with_fp16_and_csc_at_one_chunk_matches_float64():
    """ChunkSparsity(density=0.01, warmup_steps=0): the 27 elements are one chunk, always sent."""
    r = _mirrored("--accumulation=2", "--compression=fp16", "--density=0.01", "--chunk_size=1024",
                  "--warmup_steps=0", "--momentum=0")
    _assert_accumulated(r, 2)
    assert int(r["csc_step"]) == EPOCHS * EXAMPLES // BATCH // 2
    w, b, _ = _accumulation_reference(r, 2)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-3)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-3)


@_NO_ACCUMULATION
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_mirrored_gradient_accumulation_csc_residual_advances_once_per_applied_update(momentum):
    """Sparse from the first step (2 of 7 chunks): weights and each replica's residual match a
    NumPy CSC fed the averaged accumulated gradients once every 2 micro-steps."""
    r = _mirrored("--accumulation=2", "--compression=none", "--density=0.25", "--chunk_size=4",
                  "--warmup_steps=0", f"--momentum={momentum}")
    _assert_accumulated(r, 2)
    assert int(r["csc_step"]) == EPOCHS * EXAMPLES // BATCH // 2
    csc = NumpyCSC(27, 2, 4, momentum=momentum)
    w, b, residuals = _accumulation_reference(r, 2, csc, density=0.25)
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)
    for replica in range(2):
        assert np.any(residuals[replica])
        np.testing.assert_allclose(r[f"residual_r{replica}"], residuals[replica], rtol=0, atol=2e-5)


class NumpyLowRank:
    """lowrank_reference.Model (float64 low-rank, no wire rounding) of the worker's one pack on 2
    replicas, in NumpyCSC's interface: step(g [2, 27] in backprop order [b, w]) -> (the sum's
    approximation [27],); residual: [2, 24], each replica's residual of the [8, 3] kernel."""

    def __init__(self, rank):
        signature = [(tf.TensorShape([8, 3]), tf.float32), (tf.TensorShape([3]), tf.float32)]
        (spec,) = gf_tf.packing.plan_packs(signature, 0, gf_tf.wire.get(None))
        self.model = Model(LowRank(rank=rank, warmup_steps=0), spec, 2, fp16=False)

    def step(self, g, density=None):   # pylint: disable=unused-argument
        out = self.model.step([[gr[3:].reshape(8, 3), gr[:3]] for gr in g])
        return (np.concatenate([out[1], out[0].ravel()]),)

    @property
    def residual(self):
        return np.array([residuals[0].ravel() for residuals in self.model.residuals])


@_NO_ACCUMULATION
def test_mirrored_gradient_accumulation_low_rank_state_advances_once_per_applied_update():
    """LowRank(rank=1) (the 8x3 kernel compressed, the bias dense), accumulation k = 2: weights,
    each replica's residual and Q match the float64 model fed the averaged accumulated gradients
    once every 2 micro-steps."""
    r = _mirrored("--accumulation=2", "--compression=none", "--rank=1")
    _assert_accumulated(r, 2)
    reference = NumpyLowRank(rank=1)
    w, b, residuals = _accumulation_reference(r, 2, reference)
    dense_w, _, _ = _accumulation_reference(r, 2)
    assert np.abs(w - dense_w).max() > 1e-3   # rank 1 sent less than the sum: the model matters
    np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)
    for replica in range(2):
        assert np.any(residuals[replica])
        np.testing.assert_allclose(r[f"residual_r{replica}"], residuals[replica], rtol=0, atol=2e-5)
        np.testing.assert_allclose(r[f"q_r{replica}"], reference.model.qs[0], rtol=1e-5, atol=1e-5)


def _workers(*args):
    results = run_workers("multistep_worker.py", num_workers=2, timeout=180, comm_timeout=60,
                          args=[f"--epochs={EPOCHS}", f"--examples={EXAMPLES}", *args])
    assert all(r.ok and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


@pytest.mark.parametrize("reducer", [["--density=0.25"], ["--rank=1"]], ids=["csc", "lowrank"])
def test_multi_worker_multi_step_fit_equals_single_step(reducer):
    """FP16 with CSC or LowRank(rank=1): steps_per_execution=3 ends with the weights (and the
    reducer's residuals and Q's) of steps_per_execution=1, bitwise, the same on both workers."""
    one = _workers("--steps_per_execution=1", "--compression=fp16", *reducer)
    three = _workers("--steps_per_execution=3", "--compression=fp16", *reducer)
    state = [k for k in one[0] if k.startswith(("residual_r", "q_r"))]
    assert state
    for k in ("w0", "w1"):
        np.testing.assert_array_equal(one[0][k], one[1][k], err_msg=k)
        np.testing.assert_array_equal(three[0][k], three[1][k], err_msg=k)
    for worker in range(2):
        for k in ("w0", "w1", *state):
            np.testing.assert_array_equal(three[worker][k], one[worker][k], err_msg=k)
    for r in one + three:
        assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH


def test_multi_worker_multi_step_dense_fit_matches_float64_sgd():
    dense = _workers("--steps_per_execution=4", "--compression=none")
    w, b = _sgd_reference(dense[0])
    for r in dense:
        assert int(r["iterations"]) == int(r["gf_steps"]) == EPOCHS * EXAMPLES // BATCH
        np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
        np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)


@_NO_ACCUMULATION
def test_multi_worker_gradient_accumulation_matches_float64_with_fp16_and_csc():
    """2 workers of gf_tf.MultiWorkerMirroredStrategy, one replica each (worker i takes the i-th
    half of every global batch): accumulation k = 2 and 3, FP16 + CSC at one chunk, and sparse
    CSC whose weights and per-worker residuals match NumPy CSC fed once per applied update."""
    for k in (2, 3):
        dense = _workers(f"--accumulation={k}", "--compression=none")
        w, b, _ = _accumulation_reference(dense[0], k)
        for r in dense:
            _assert_accumulated(r, k)
            np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
            np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)
    csc = ["--accumulation=2", "--warmup_steps=0"]
    runs = {"fp16_one_chunk": _workers(*csc, "--compression=fp16", "--density=0.01",
                                       "--chunk_size=1024", "--momentum=0"),
            "sparse": _workers(*csc, "--compression=none", "--density=0.25", "--momentum=0.9"),
            "fp16_sparse": _workers(*csc, "--compression=fp16", "--density=0.25", "--momentum=0.9")}
    for results in runs.values():
        for k in ("w0", "w1"):
            np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)
        for r in results:
            _assert_accumulated(r, 2)
            assert int(r["csc_step"]) == EPOCHS * EXAMPLES // BATCH // 2
    w, b, _ = _accumulation_reference(runs["fp16_one_chunk"][0], 2)
    np.testing.assert_allclose(runs["fp16_one_chunk"][0]["w0"], w, rtol=0, atol=2e-3)
    np.testing.assert_allclose(runs["fp16_one_chunk"][0]["w1"], b, rtol=0, atol=2e-3)
    sparse = runs["sparse"]
    w, b, residuals = _accumulation_reference(sparse[0], 2, NumpyCSC(27, 2, 4, momentum=0.9), 0.25)
    np.testing.assert_allclose(sparse[0]["w0"], w, rtol=0, atol=2e-5)
    np.testing.assert_allclose(sparse[0]["w1"], b, rtol=0, atol=2e-5)
    for worker in range(2):
        assert np.any(residuals[worker])
        np.testing.assert_allclose(sparse[worker]["residual_r0"], residuals[worker], rtol=0, atol=2e-5)


@_NO_ACCUMULATION
def test_multi_worker_gradient_accumulation_with_low_rank_matches_float64():
    """2 workers, LowRank(rank=1), accumulation k = 2: the same weights on both, matching the
    float64 model fed once per applied update, and each worker's residual its replica's there."""
    results = _workers("--accumulation=2", "--compression=none", "--rank=1")
    for k in ("w0", "w1", "q_r0"):
        np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)
    reference = NumpyLowRank(rank=1)
    w, b, residuals = _accumulation_reference(results[0], 2, reference)
    for worker, r in enumerate(results):
        _assert_accumulated(r, 2)
        np.testing.assert_allclose(r["w0"], w, rtol=0, atol=2e-5)
        np.testing.assert_allclose(r["w1"], b, rtol=0, atol=2e-5)
        np.testing.assert_allclose(r["residual_r0"], residuals[worker], rtol=0, atol=2e-5)
