"""CSC across 2 worker processes on 127.0.0.1 (TF_CONFIG, real collectives, Keras model.fit)."""

import math

import numpy as np
import pytest

from cluster import describe, run_workers
from gf_tf.csc import AUTO_LADDER, MIN_CHUNKS

# slow: every test starts 2 worker processes (tests/workers/csc_fit_worker.py).
pytestmark = pytest.mark.slow

# The worker's model: Dense(8->32) + Dense(32->3) = 387 parameters, one pack.
PARAMS = 8 * 32 + 32 + 32 * 3 + 3


def _run(*args, workers=2):
    results = run_workers("csc_fit_worker.py", num_workers=workers, args=list(args),
                          timeout=90 + 30 * (workers - 2), comm_timeout=30)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


def _assert_identical_weights(a, b):
    names = sorted(k for k in a if k.startswith("w"))
    assert names
    for k in names:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fit_with_csc_identical_weights_and_chunk_sized_collectives():
    cs, density, steps = 16, 0.1, 5
    c = math.ceil(PARAMS / cs)                  # 25 chunks, the last of 3 elements
    k = math.ceil(density * c)                  # 3
    a, b = _run(f"--density={density}", f"--chunk_size={cs}", f"--steps={steps}")
    assert int(a["num_params"]) == PARAMS
    _assert_identical_weights(a, b)
    # Each worker keeps its own error-feedback residual (different data shards).
    assert np.any(a["residual"] != b["residual"])
    assert np.count_nonzero(a["residual"]) > PARAMS // 2
    for r in (a, b):
        pairs = sorted(zip(r["reduce_dtypes"].tolist(), r["reduce_elements"].tolist()))
        # Gradients: the float32 chunk norms and k whole chunks in float16, nothing else.
        assert ("float32", c) in pairs and ("float16", k * cs) in pairs, pairs
        assert not any(d == "float16" and e != k * cs for d, e in pairs), pairs
        assert int(r["csc_steps"]) == steps
        np.testing.assert_array_equal(
            r["per_step"], [[4 * PARAMS, 4 * c + 2 * k * cs, k, c]] * steps)
        assert float(r["compression_ratio"]) == pytest.approx(4 * PARAMS / (4 * c + 2 * k * cs))


@pytest.mark.parametrize("workers", [2, 3])
def test_ahead_selection_is_bitwise_the_same_on_every_worker_in_one_collective(workers):
    """selection="ahead": the workers' next-step scores (which choose the chunks) and weights
    are the same bits; the sparse step's one float16 all-reduce carries k chunks, the C scores
    and the bound; its float32 twin is the overflow retry; the warm-up step sends the float32
    norms, then the whole pack."""
    cs, density, steps = 16, 0.1, 6
    c = math.ceil(PARAMS / cs)                  # 25 chunks, the last of 3 elements
    k = math.ceil(density * c)                  # 3
    results = _run(f"--density={density}", f"--chunk_size={cs}", f"--steps={steps}",
                   "--warmup_steps=2", "--selection=ahead", "--momentum=0.9", workers=workers)
    for r in results[1:]:
        _assert_identical_weights(results[0], r)
        assert r["scores"].tobytes() == results[0]["scores"].tobytes()
        assert r["bound"].tobytes() == results[0]["bound"].tobytes()
    assert np.count_nonzero(results[0]["scores"]) > c // 2
    for r in results:
        pairs = sorted(p for p in zip(r["reduce_dtypes"].tolist(), r["reduce_elements"].tolist())
                       if p[1] > 1)   # not the loss and metric sums
        assert pairs == sorted([("float16", k * cs + c + 1), ("float32", k * cs + c + 1),
                                ("float32", c), ("float16", PARAMS)]), pairs
        np.testing.assert_array_equal(r["per_step"][2:], [[4 * PARAMS, 2 * (k * cs + c + 1), k, c]]
                                      * (steps - 2))


def test_fit_with_exponential_warmup_and_momentum_stays_in_lockstep():
    """The warm-up stages switch inside the single traced step (tf.switch_case
    over static k): both workers must switch together or the collectives hang."""
    cs, steps = 4, 6
    c = math.ceil(PARAMS / cs)                  # 97 chunks
    a, b = _run("--density=0.01", f"--chunk_size={cs}", f"--steps={steps}",
                "--warmup_steps=3", "--warmup=exponential", "--momentum=0.9")
    _assert_identical_weights(a, b)
    ks = [math.ceil(d * c) for d in (0.25, 0.0625, 0.015625)] + [1] * 3   # 25, 7, 2, 1, 1, 1
    for r in (a, b):
        np.testing.assert_array_equal(r["per_step"][:, 2], ks)
        np.testing.assert_array_equal(r["per_step"][:, 1], [4 * c + 2 * k * cs for k in ks])
        assert np.all(np.isfinite(r["residual"]))


def _auto_k(density, c):
    return max(1, math.ceil(round(density * c, 9)))


def test_auto_density_decides_on_all_reduced_figures_of_both_workers():
    """density="auto", 97 chunks of 4, budget 0.25 s per 1 s of compute. Worker 0's clock
    measures 0.03 s of communication per step, worker 1's 0.35 s: alone, worker 0 would pick
    25 chunks at step 1 and worker 1 the floor (and their collectives would not match). From
    the all-reduced figures (mean 0.19 s; bytes per step 404 + 8 k on the float16 wire; the
    price alone, as the worker builds `AutoDensity` for a fake clock):
      step 0: nothing measured: floor, k=1 (412 B)
      step 1: 0.19 s at 412 B -> 25: 0.279 s; 10: 0.223 s fits -> k=10
      step 2: 0.19 s at 484 B -> 25: 0.237 s fits -> k=25, and so on."""
    cs, steps, c = 4, 5, math.ceil(PARAMS / 4)
    results = run_workers("csc_fit_worker.py", num_workers=2, timeout=90, comm_timeout=30,
                          args=["--density=auto", f"--chunk_size={cs}", f"--steps={steps}",
                                "--auto_budget=0.25", "--min_density=0.001"],
                          per_worker_args=[["--fake_clock=1.0,0.03"], ["--fake_clock=1.0,0.35"]])
    assert all(r.ok and r.result is not None for r in results), describe(results)
    a, b = [r.result for r in results]
    _assert_identical_weights(a, b)
    densities = [0.001, 0.1, 0.25, 0.25, 0.25]
    ks = [_auto_k(d, c) for d in densities]
    assert ks == [1, 10, 25, 25, 25]
    for r in (a, b):
        np.testing.assert_array_equal(r["per_step"][:, 2], ks)
        np.testing.assert_array_equal(r["per_step"][:, 1], [16 + 4 * c + 2 * k * cs for k in ks])
        np.testing.assert_allclose(r["per_step_density"], densities, rtol=1e-12)
        pairs = set(zip(r["reduce_dtypes"].tolist(), r["reduce_elements"].tolist()))
        assert ("float32", 4 + c) in pairs, pairs       # the rule's figures ride with the norms


def test_auto_density_with_the_real_clock_stays_in_lockstep():
    """Real timestamps differ between the workers; both still choose the same density at
    every step (or their chunk all-reduces would not match and time out)."""
    cs, steps, c = 4, 6, math.ceil(PARAMS / 4)
    a, b = _run("--density=auto", f"--chunk_size={cs}", f"--steps={steps}", "--warmup_steps=2",
                "--momentum=0.9")
    _assert_identical_weights(a, b)
    np.testing.assert_array_equal(a["per_step"], b["per_step"])
    np.testing.assert_array_equal(a["per_step_density"], b["per_step_density"])
    for r in (a, b):
        assert r["per_step_density"][:2].tolist() == [1.0, 1.0]       # dense warm-up
        for d, k in zip(r["per_step_density"][2:], r["per_step"][2:, 2]):
            rung = min(AUTO_LADDER, key=lambda x: abs(x - d))
            assert d == pytest.approx(rung, rel=1e-12) and k == min(c, max(MIN_CHUNKS, _auto_k(rung, c)))
        assert np.all(np.isfinite(r["residual"]))


def test_auto_on_one_worker_only_fails_fast_naming_the_density():
    results = run_workers("csc_fit_worker.py", num_workers=2, timeout=90, comm_timeout=30,
                          per_worker_args=[["--density=auto"], ["--density=0.01"]])
    for r in results:
        assert r.returncode not in (0, None), describe(results)
        assert "settings differ across workers" in r.output, describe(results)
        assert "sparsity density: worker 0 = auto, worker 1 = 0.01" in r.output, describe(results)
