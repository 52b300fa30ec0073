"""gf_tf.ops' low-rank passes (lowrank_project, lowrank_project_back, lowrank_reconstruct)
against a NumPy float64 reference, for the compiled kernels and the composite, on fresh random
inputs: empty, single-element and prime shapes, a row count past the kernels' blocks, every
gradient dtype, NaN, inf, float16's largest value and subnormals, outputs past the caches.

A float32 sum of k products differs from the exact one by at most k eps sum |products| (eps =
2^-24): the tolerance each assertion uses, so a wrong element fails and rounding does not.
"""

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import ops
from gf_tf.ops import _library

RNG = np.random.default_rng()
EPS = 2.0 ** -24
DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
SHAPES = [(1, 1, 1), (7, 1009, 2), (1009, 7, 3), (0, 5, 2), (5, 0, 2), (33, 17, 1),
          (16387, 3, 2), (64, 64, 4)]


@pytest.fixture(params=["compiled", "composite"])
def impl(request):
    if request.param == "compiled" and _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    return getattr(ops, request.param)


def as_f64(t):
    return tf.cast(t, tf.float64).numpy()


def random_matrix(n, m, dtype=tf.float32, spread=2.0):
    """A tensor of `dtype` [n, m] with magnitudes over 10^+-spread, and its exact float64 values."""
    values = RNG.normal(size=(n, m)) * 10.0 ** RNG.uniform(-spread, spread, (n, m))
    t = tf.cast(tf.constant(values, tf.float64), dtype)
    return t, as_f64(t)


def float32(values) -> np.ndarray:
    return np.asarray(values, np.float64).astype(np.float32)


def assert_within_sum_bound(actual, exact, magnitude, terms):
    """|actual - exact| <= (terms + 1) eps magnitude elementwise, NaN where exact is NaN."""
    actual = np.asarray(actual, np.float64)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(exact))
    ok = ~np.isnan(exact)
    assert np.all(np.abs(actual[ok] - exact[ok]) <= (terms + 1) * EPS * magnitude[ok] + 1e-300)


def project_reference(grad64, residual32, q32):
    matrix = float32(grad64.astype(np.float32) + residual32).astype(np.float64)
    return matrix, matrix @ q32, np.abs(matrix) @ np.abs(q32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_project_matches_reference(impl, shape, dtype):
    n, m, r = shape
    grad, grad64 = random_matrix(n, m, dtype)
    residual = float32(RNG.normal(size=(n, m)))
    q = float32(RNG.normal(size=(m, r)))
    matrix, p, bound = impl.lowrank_project(grad, tf.constant(residual), tf.constant(q))
    expected_matrix, expected_p, magnitude = project_reference(grad64, residual, q)
    np.testing.assert_array_equal(matrix.numpy(), expected_matrix)   # one float32 addition
    assert p.shape == (n, r) and p.dtype == tf.float32
    assert_within_sum_bound(p.numpy(), expected_p, magnitude, m)
    squares = (expected_matrix ** 2).sum(axis=0)
    expected_bound = np.sqrt(squares.max()) if squares.size else 0.0
    assert abs(float(bound) - expected_bound) <= (n + 2) * EPS * expected_bound


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_project_back_matches_reference(impl, shape):
    n, m, r = shape
    matrix, matrix64 = random_matrix(n, m)
    p = float32(RNG.normal(size=(n, r)))
    q = impl.lowrank_project_back(matrix, tf.constant(p))
    assert q.shape == (m, r) and q.dtype == tf.float32
    assert_within_sum_bound(q.numpy(), matrix64.T @ p, np.abs(matrix64).T @ np.abs(p), n)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_reconstruct_matches_reference(impl, shape, dtype):
    n, m, r = shape
    matrix, matrix64 = random_matrix(n, m)
    a, c = (float32(RNG.normal(size=(n, r))) for _ in range(2))
    b, d = (float32(RNG.normal(size=(m, r))) for _ in range(2))
    out, residual = impl.lowrank_reconstruct(matrix, a, b, c, d, dtype)
    assert out.dtype == dtype and out.shape == (n, m) and residual.shape == (n, m)
    # out: a float32 sum of r products, then one rounding to `dtype`.
    exact = a.astype(np.float64) @ b.T
    in_float32 = np.abs(as_f64(tf.cast(tf.constant(exact), tf.float32)) - exact)
    rounded = np.abs(as_f64(tf.cast(tf.constant(exact), dtype)) - exact)
    slack = (r + 1) * EPS * (np.abs(a) @ np.abs(b).T)
    assert np.all(np.abs(as_f64(out) - exact) <= np.maximum(in_float32, rounded) * 2 + slack * 2)
    assert_within_sum_bound(residual.numpy(), matrix64 - c.astype(np.float64) @ d.T,
                            np.abs(matrix64) + np.abs(c) @ np.abs(d).T, r + 1)


def test_nan_inf_and_float16_extremes_pass_through(impl):
    """A NaN or inf in the gradient reaches P's row, the bound and the residual; float16's
    largest value (65504) and subnormals arrive in float32 exactly."""
    n, m = 6, 9
    values = RNG.normal(size=(n, m))
    values[0, 3] = np.nan
    values[2, 5] = np.inf
    values[3, :] = 65504.0
    values[4, :] = 2.0 ** -24   # float16's smallest subnormal
    grad = tf.constant(values, tf.float16)
    residual = np.zeros((n, m), np.float32)
    q = float32(RNG.normal(size=(m, 2)))
    matrix, p, bound = impl.lowrank_project(grad, residual, q)
    np.testing.assert_array_equal(matrix.numpy(), as_f64(grad).astype(np.float32))
    assert np.all(np.isnan(p.numpy()[0])) and np.all(~np.isfinite(p.numpy()[2]))
    assert np.isnan(float(bound))
    out, new_residual = impl.lowrank_reconstruct(matrix, p, q, p, q, tf.float32)
    assert np.all(np.isnan(new_residual.numpy()[0]))
    np.testing.assert_array_equal(np.isfinite(out.numpy()[4]), True)


def test_large_outputs_match_the_composite_within_rounding():
    """Outputs past the caches (the kernels' streaming stores, several threads' blocks)."""
    if _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    n, m, r = 2100, 2048, 2
    grad, grad64 = random_matrix(n, m, spread=1.0)
    residual = float32(RNG.normal(size=(n, m)))
    q = float32(RNG.normal(size=(m, r)))
    matrix, p, _ = ops.compiled.lowrank_project(grad, residual, q)
    expected_matrix, expected_p, magnitude = project_reference(grad64, residual, q)
    np.testing.assert_array_equal(matrix.numpy(), expected_matrix)
    assert_within_sum_bound(p.numpy(), expected_p, magnitude, m)
    q_back = ops.compiled.lowrank_project_back(matrix, p)
    assert_within_sum_bound(q_back.numpy(), expected_matrix.T @ p.numpy(),
                            np.abs(expected_matrix).T @ np.abs(p.numpy()), n)
    out, new_residual = ops.compiled.lowrank_reconstruct(matrix, p, q, p, q_back, tf.float32)
    p64, q64, back64 = (np.asarray(x, np.float64) for x in (p, q, q_back))
    assert_within_sum_bound(out.numpy(), p64 @ q64.T, np.abs(p64) @ np.abs(q64).T, r)
    assert_within_sum_bound(new_residual.numpy(), expected_matrix - p64 @ back64.T,
                            np.abs(expected_matrix) + np.abs(p64) @ np.abs(back64).T, r + 1)


@pytest.mark.parametrize("call, message", [
    (lambda o: o.lowrank_project(tf.zeros([3, 4]), tf.zeros([3, 5]), tf.zeros([4, 2])),
     "residual"),
    (lambda o: o.lowrank_project(tf.zeros([3, 4]), tf.zeros([3, 4]), tf.zeros([5, 2])), "q"),
    (lambda o: o.lowrank_project_back(tf.zeros([3, 4]), tf.zeros([4, 2])), "p"),
    (lambda o: o.lowrank_reconstruct(tf.zeros([3, 4]), tf.zeros([3, 2]), tf.zeros([4, 2]),
                                     tf.zeros([3, 2]), tf.zeros([4, 3]), tf.float32), "d"),
], ids=["residual", "q", "p", "d"])
def test_shapes_that_do_not_pair_are_refused(impl, call, message):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as raised:
        call(impl)
    if impl is ops.compiled:
        assert message in str(raised.value)


def test_dtypes_outside_the_sets_are_refused(impl):
    with pytest.raises(TypeError, match="matrix has dtype int32"):
        impl.lowrank_project(tf.zeros([2, 2], tf.int32), tf.zeros([2, 2]), tf.zeros([2, 1]))
    with pytest.raises(TypeError, match="q must be float32"):
        impl.lowrank_project(tf.zeros([2, 2]), tf.zeros([2, 2]), tf.zeros([2, 1], tf.float64))
    with pytest.raises(ValueError, match="must be 2-D"):
        impl.lowrank_project_back(tf.zeros([4]), tf.zeros([4, 1]))
