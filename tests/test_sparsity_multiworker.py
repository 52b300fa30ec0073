"""CSC across 2 worker processes on 127.0.0.1 (TF_CONFIG, real collectives, Keras model.fit)."""

import math

import numpy as np
import pytest

from cluster import describe, run_workers

# The worker's model: Dense(8->32) + Dense(32->3) = 387 parameters, one pack.
PARAMS = 8 * 32 + 32 + 32 * 3 + 3


def _run(*args):
    results = run_workers("csc_fit_worker.py", num_workers=2, args=list(args),
                          timeout=90, comm_timeout=30)
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
