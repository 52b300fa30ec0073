"""The planner across worker processes (TF_CONFIG on 127.0.0.1, real collectives): every worker
measures, the figures are averaged, and every worker plans the same from them."""

import numpy as np
import pytest

from cluster import describe, run_workers

# slow: every test starts worker processes (tests/workers/planner_worker.py).
pytestmark = pytest.mark.slow


def _run(num_workers, *args):
    results = run_workers("planner_worker.py", num_workers=num_workers, args=list(args),
                          timeout=60 + 30 * num_workers, comm_timeout=30)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


def _check(results):
    first = results[0]
    for other in results[1:]:
        np.testing.assert_array_equal(other["costs"], first["costs"])   # the same figures, bitwise
        assert list(other["plans"]) == list(first["plans"])
        np.testing.assert_array_equal(other["seconds"], first["seconds"])
    assert np.all(first["costs"] >= 0) and first["costs"][0] > 0
    for key in first:
        if "_sum" not in key:
            continue
        sent = key.replace("_sum", "_sent")
        reference = np.sum([r[sent].astype(np.float64) for r in results], axis=0)
        # Whatever the plan: float32 (TF's own or float32 packs) or FP16 scaled to the tensor's
        # bound, the SUM over workers of max |g| (tests/test_overlap.py: why not the sum's max).
        bound = np.sum([np.max(np.abs(r[sent].astype(np.float64)), initial=0.0) for r in results])
        tolerance = 2.0 ** -10 * bound * len(results)
        for r in results:
            np.testing.assert_allclose(r[key], reference, rtol=0, atol=tolerance, err_msg=key)
            np.testing.assert_array_equal(r[key], first[key])   # every worker holds the same sum


def test_two_workers_with_different_local_timings_plan_alike():
    _check(_run(2))


def test_four_workers_with_different_local_timings_plan_alike():
    _check(_run(4, "--skew", "10"))
