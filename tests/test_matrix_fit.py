"""The matrix's end-to-end cell check: 2 worker processes, `tf.keras` fit with FP16 + CSC.

Runs with whichever Keras flavour the cell selects (TF_USE_LEGACY_KERAS=1: tf-keras). The
workers must end with identical weights (every collective agreed) and learn digits well above
chance (10 classes: 10%), and GradientFlowStats must report the compression.
"""

import numpy as np
import pytest

from cluster import describe, run_workers

from gf_tf.keras import flavour

pytestmark = pytest.mark.slow


def test_two_worker_fit_with_fp16_and_csc_agrees_and_learns():
    results = run_workers("matrix_fit_worker.py", num_workers=2, timeout=240, comm_timeout=60)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    a, b = (r.result for r in results)
    for r in (a, b):
        assert str(r["flavour"]) == flavour.flavour()
        assert float(r["accuracy"]) > 0.7, describe(results)
        # Warm-up epoch(s) dense FP16 (2x), then 10% of the chunks.
        assert r["compression_ratio"][0] >= 2.0 and r["compression_ratio"][-1] > 4.0, r["compression_ratio"]
        assert np.all(np.isfinite(r["loss"])) and r["loss"][-1] < r["loss"][0]
    names = sorted(k for k in a if k.startswith("w"))
    assert len(names) == 4
    for k in names:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
