"""The 16-bit wire stays accurate at hundreds of workers (relative L2 error of a SUM vs float64).

Measured on N logical CPUs with MirroredStrategy's own collectives (one fresh process per N,
benchmarks/fp16_accuracy.py), and modelled in NumPy (a float16 ring whose every hop rounds its
partial sum) up to the paper's 512 workers, with the exact scale (CSC, low rank) and the dense
reducer's scale a step ahead, steady and after the largest drop it still sends in FP16. Targets:
at every gradient scale s from 1e-8 to 1e2, error <= 0.1% for N <= 8 and <= 0.25% for N <= 64.
"""

import numpy as np
import pytest

from benchmarks import fp16_accuracy as acc
from gf_tf.wire import SCALE_TARGET_EXPONENT, power_of_two_scale_np

SCALES = (1e-8, 1e-5, 1e-2, 1e2)


def limit(n):
    return 0.001 if n <= 8 else 0.0025


@pytest.mark.parametrize("scheme", ["pow2", "ahead", "ahead_drop"])
@pytest.mark.parametrize("n", [2, 8, 64, 512])
def test_modelled_ring_error_with_the_power_of_two_scale(n, scheme):
    for s in SCALES:
        g = acc.gradients(n, s, seed=n)
        exact = g.astype(np.float64).sum(axis=0)
        error = acc.relative_error(acc.ring_model(g, scheme), exact)
        assert error <= (limit(n) if n <= 64 else 0.004), (n, s, error)
        assert np.all(np.isfinite(acc.ring_model(g, scheme)))
    # The same model reproduces the former 1/N prescale's loss of small gradients.
    g = acc.gradients(n, 1e-5, seed=n)
    old = acc.relative_error(acc.ring_model(g, "1/N"), g.astype(np.float64).sum(axis=0))
    assert old > {2: 0.002, 8: 0.01, 64: 0.08, 512: 0.5}[n], old


def test_power_of_two_scale_keeps_every_partial_sum_below_fp16_max():
    rng = np.random.default_rng(0)
    bounds = np.concatenate([10.0 ** rng.uniform(-40, 38, 1000), [2.0 ** 15, 65504.0, 1e-45]])
    scale = power_of_two_scale_np(bounds)
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))             # powers of two
    inside = (bounds > 2.0 ** -110) & (bounds < 2.0 ** 140)
    assert np.all(bounds[inside] * scale[inside] < 2.0 ** SCALE_TARGET_EXPONENT)
    assert np.all(bounds[inside] * scale[inside] >= 2.0 ** (SCALE_TARGET_EXPONENT - 1))
    np.testing.assert_array_equal(power_of_two_scale_np([0.0, np.inf, np.nan, 1e-40]), [1.0] * 4)


def test_tensorflow_and_numpy_scales_agree_bit_for_bit():
    import tensorflow as tf   # pylint: disable=import-outside-toplevel
    from gf_tf.wire import power_of_two_scale   # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(1)
    edges = [2.0 ** 15, 2.0 ** 14, 65504.0, 2.0 ** -126, 3.4e38, 1e-45, 0.0, np.inf, -np.inf, np.nan]
    bounds = np.concatenate([10.0 ** rng.uniform(-44, 38, 20000), edges]).astype(np.float32)
    bounds = np.concatenate([bounds, np.nextafter(bounds, np.float32(np.inf)),
                             np.nextafter(bounds, np.float32(0))])
    got = power_of_two_scale(tf.constant(bounds)).numpy()
    np.testing.assert_array_equal(got, power_of_two_scale_np(bounds).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8, 32, 64])
def test_measured_fp16_error_of_the_sum_meets_the_targets(n):
    measured = acc.run_worker(n, SCALES, compressions=("fp16",))
    for name in ("fp16", "fp16_after_drop"):
        for s, fp16 in zip(SCALES, measured[name]):
            # Above float32's own error: the measured step went on the 16-bit wire (measure raises
            # where it was retried in float32).
            assert 1e-5 < fp16 <= limit(n), (n, s, name, fp16)
