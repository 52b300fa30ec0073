"""gf_tf.ops against a NumPy float64 reference, for every implementation.

Each test runs on the compiled kernels (vector path and forced scalar path)
and on the composite-TF implementation, with fresh random inputs, and checks
values (exactly where the contract defines them exactly).
"""

import os
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import ops
from gf_tf.ops import _library

F16, BF16, F32, F64 = tf.float16, tf.bfloat16, tf.float32, tf.float64
BF16_MAX = float.fromhex("0x1.fep127")
RNG = np.random.default_rng()


# ---------------------------------------------------------------------------
# Implementations under test.
# ---------------------------------------------------------------------------

def _with_simd_off(fn):
    return lambda *args, **kwargs: fn(*args, simd=False, **kwargs)


IMPLEMENTATIONS = {
    "compiled": ops.compiled,
    "compiled_scalar": type(ops.compiled)(**{k: _with_simd_off(v) for k, v in
                                              vars(ops.compiled).items()
                                              if callable(v) and not k.startswith("lowrank_")}),
    "composite": ops.composite,
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(request):
    if request.param.startswith("compiled") and _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    return IMPLEMENTATIONS[request.param]


# ---------------------------------------------------------------------------
# NumPy float64 reference.
# ---------------------------------------------------------------------------

def bf16_round(y):
    """float64 -> nearest bfloat16 value (ties to even), as float64."""
    y = np.array(y, np.float64)
    out = y.copy()
    finite = np.isfinite(y) & (y != 0)
    mantissa, exponent = np.frexp(y[finite])
    assert np.all(np.abs(y[finite]) >= 2.0 ** -126), "bfloat16 subnormals are not modelled"
    r = np.ldexp(np.round(mantissa * 256.0), exponent - 8)  # np.round: ties to even
    r[np.abs(r) > BF16_MAX] = np.copysign(np.inf, r[np.abs(r) > BF16_MAX])
    out[finite] = r
    return out


def round_to(y, dtype):
    """float64 values -> nearest value of `dtype` (one rounding), as float64."""
    y = np.asarray(y, np.float64)
    if dtype == F64:
        return y.copy()
    with np.errstate(over="ignore"):  # beyond the range: +-inf, as the contract says
        if dtype == F32:
            return y.astype(np.float32).astype(np.float64)
        if dtype == F16:
            return y.astype(np.float16).astype(np.float64)
    return bf16_round(y)


def ref_to_wire(x, in_dtype, wire, scale):
    """The pack contract: x * scale in float32 (float64 for float64 x), one cast."""
    s = np.float64(np.float32(scale))
    y = x * s if in_dtype == F64 else round_to(x * s, F32)  # float32 products are exact in float64
    return round_to(y, wire)


def ref_from_wire(w, out_dtype, scale):
    """The unpack contract: float32(w) * scale in float32, cast to out_dtype."""
    return round_to(round_to(w * np.float64(np.float32(scale)), F32), out_dtype)


def as_f64(t):
    return tf.cast(t, F32).numpy().astype(np.float64) if t.dtype == BF16 else \
        t.numpy().astype(np.float64)


def make_tensor(values, dtype):
    """Tensor of `dtype` holding exactly round_to(values, dtype); returns (tensor, exact float64)."""
    exact = round_to(values, dtype)
    if dtype == BF16:
        return tf.cast(tf.constant(exact.astype(np.float32)), BF16), exact
    return tf.constant(exact, dtype), exact


def random_tensors(sizes, dtypes=(F32,), spread=3.0):
    """Tensors of the given sizes (varied shapes), dtypes cycling; returns (tensors, flat float64)."""
    tensors, flat = [], []
    for i, n in enumerate(sizes):
        shape = [n] if n % 2 or n == 0 else [2, n // 2]
        t, exact = make_tensor(RNG.normal(size=n) * 10.0 ** RNG.uniform(-spread, spread, n),
                               dtypes[i % len(dtypes)])
        tensors.append(tf.reshape(t, shape))
        flat.append(exact)
    return tensors, (np.concatenate(flat) if flat else np.zeros(0))


def assert_same(actual, expected):
    """Exactly equal values, NaN where NaN expected."""
    np.testing.assert_array_equal(as_f64(actual), np.asarray(expected, np.float64))


SIZE_CASES = {
    "no_tensors": [],
    "only_empty": [0, 0],
    "one_element": [1],
    "seven": [7],
    "prime_1009": [1009],
    "mixed": [7, 0, 1, 1009, 3],
    "one_much_larger": [5, 40000, 2, 9],
}
GRAD_DTYPES = (F32, F64, F16, BF16)


# ---------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", list(SIZE_CASES.values()), ids=list(SIZE_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_pack_matches_reference(impl, sizes, wire):
    tensors, flat = random_tensors(sizes, GRAD_DTYPES, spread=2.0)
    scale = float(RNG.choice([1.0, 0.25, 1.0 / 3.0]))
    packed = impl.pack(tensors, wire, scale)
    assert packed.dtype == wire and packed.shape == (len(flat),)
    offsets = np.cumsum([0] + [int(np.prod(t.shape)) for t in tensors])
    expected = [ref_to_wire(flat[b:e], t.dtype, wire, scale)
                for t, b, e in zip(tensors, offsets[:-1], offsets[1:])]
    assert_same(packed, np.concatenate(expected) if expected else [])


SPECIALS = [65504.0, 65520.0, -7e4, 6e-8, 1e-9, np.nan, np.inf, -np.inf, 1.0, -2.5]
SPECIALS_AS_FP16 = [65504.0, np.inf, -np.inf, 2.0 ** -24, 0.0, np.nan, np.inf, -np.inf, 1.0, -2.5]


@pytest.mark.parametrize("length", [10, 37], ids=["tail_only", "vector_and_tail"])
def test_pack_fp16_special_values(impl, length):
    values = np.resize(np.array(SPECIALS), length)
    packed = impl.pack([tf.constant(values, F32)], F16, 1.0)
    assert_same(packed, np.resize(np.array(SPECIALS_AS_FP16), length))


def test_pack_bf16_special_values(impl):
    one_ulp = 2.0 ** -7
    values = np.resize(np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1.0 + one_ulp / 2,
                                 1.0 + 1.5 * one_ulp, 6e-8, 0.0]), 41)
    expected = np.resize(np.array([np.nan, np.inf, -np.inf, np.inf, -np.inf, 1.0,
                                   1.0 + 2 * one_ulp, bf16_round(6e-8)[()], 0.0]), 41)
    assert_same(impl.pack([tf.constant(values, F32)], BF16, 1.0), expected)


@pytest.mark.parametrize("wire", [F16, BF16], ids=["fp16", "bf16"])
def test_pack_rounds_float64_once(impl, wire):
    # Just above the halfway point between two wire values, by less than a float32 ulp:
    # rounding through float32 first would land on the tie and round down to even.
    ulp = 2.0 ** -10 if wire == F16 else 2.0 ** -7
    value = 1.0 + ulp / 2 + 2.0 ** -40
    assert_same(impl.pack([tf.constant([value, -value], F64)], wire, 1.0), [1.0 + ulp, -1.0 - ulp])


@pytest.mark.parametrize("sizes", list(SIZE_CASES.values()), ids=list(SIZE_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_unpack_matches_reference(impl, sizes, wire):
    wire_tensor, wire_values = make_tensor(RNG.normal(size=sum(sizes)) * 100.0, wire)
    wire_values = np.where(np.abs(wire_values) < 1e-30, 1.0, wire_values)  # no bf16 subnormals
    wire_tensor = make_tensor(wire_values, wire)[0]
    shapes = [[n] if n % 2 or n == 0 else [2, n // 2] for n in sizes]
    dtypes = [GRAD_DTYPES[i % 4] for i in range(len(sizes))]
    scale = float(RNG.choice([1.0, 4.0, 3.0]))
    outputs = impl.unpack(wire_tensor, shapes, dtypes, scale)
    assert len(outputs) == len(sizes)
    offset = 0
    for out, shape, dtype, n in zip(outputs, shapes, dtypes, sizes):
        assert out.dtype == dtype and out.shape.as_list() == shape
        expected = ref_from_wire(wire_values[offset:offset + n], dtype, scale)
        assert_same(tf.reshape(out, [-1]), expected)
        offset += n


def test_unpack_special_values(impl):
    values = np.resize(np.array(SPECIALS_AS_FP16), 29)
    (out,) = impl.unpack(tf.constant(values, F16), [[29]], [F32], 2.0)
    assert_same(out, values * 2.0)


@pytest.mark.parametrize("wire", [F16, BF16], ids=["fp16", "bf16"])
def test_round_trip_with_prescale_and_postscale(impl, wire):
    num_replicas = 4
    tensors, flat = random_tensors([1009, 7, 1], (F32, F64), spread=2.0)
    packed = impl.pack(tensors, wire, 1.0 / num_replicas)
    restored = impl.unpack(packed, [t.shape for t in tensors], [t.dtype for t in tensors],
                           float(num_replicas))
    got = np.concatenate([as_f64(tf.reshape(t, [-1])) for t in restored])
    relative_precision = 2.0 ** -11 if wire == F16 else 2.0 ** -8
    np.testing.assert_allclose(got, flat, rtol=relative_precision, atol=4 * 2.0 ** -24)


# ---------------------------------------------------------------------------
# chunk ops
# ---------------------------------------------------------------------------

CHUNK_CASES = {  # (sizes, chunk_size)
    "partial_last_chunk": ([1000, 1], 100),   # 11 chunks, the last of 1 element
    "chunk_size_1": ([5, 8], 1),
    "chunk_larger_than_buffer": ([7, 3], 5000),
    "mixed_sizes": ([7, 1009, 1, 0], 64),
    "one_much_larger": ([3, 20000, 5], 1000),
    "only_empty": ([0, 0], 4),
}


def ref_norms(acc, chunk_size):
    if len(acc) == 0:
        return np.zeros(0)
    return np.add.reduceat(np.abs(acc), np.arange(0, len(acc), chunk_size))


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
@pytest.mark.parametrize("with_velocity", [False, True], ids=["plain", "momentum"])
def test_accumulate_matches_reference(impl, case, with_velocity):
    sizes, chunk_size = case
    tensors, grad = random_tensors(sizes, (F32, F64, F16), spread=1.0)
    n = len(grad)
    residual = round_to(RNG.normal(size=n), F32)
    velocity = round_to(RNG.normal(size=n), F32) if with_velocity else None
    momentum = 0.9 if with_velocity else 0.0
    acc, norms, new_velocity = impl.accumulate(
        tf.constant(residual, F32), tensors, chunk_size,
        None if velocity is None else tf.constant(velocity, F32), momentum)

    g = round_to(grad, F32)  # float64 gradients are rounded once to float32
    if with_velocity:
        u = round_to(round_to(np.float64(np.float32(momentum)) * velocity, F32) + g, F32)
        assert_same(new_velocity, u)
    else:
        u = g
        assert new_velocity is None
    expected_acc = round_to(residual + u, F32)
    assert_same(acc, expected_acc)
    assert norms.shape == (ops.num_chunks(n, chunk_size),)
    np.testing.assert_allclose(as_f64(norms), ref_norms(expected_acc, chunk_size), rtol=2e-6)


LOOKAHEAD_CASES = {  # (sizes, chunk_size)
    "empty": ([0], 3),
    "one_element": ([1], 1),
    "seven_in_chunks_of_3": ([7], 3),
    "prime_1009_in_chunks_of_1024": ([1009], 1024),
    "partial_last_chunk_of_1024": ([2000, 1, 97], 1024),
    "chunk_size_1": ([5, 8], 1),
    "mixed_sizes_in_chunks_of_3": ([7, 1009, 1, 0], 3),
}


def ref_accumulate(residual, grad, velocity, momentum):
    """(acc, u): the accumulate contract in float32 steps, as float64."""
    m = np.float64(np.float32(momentum))
    u = round_to(round_to(m * velocity, F32) + round_to(grad, F32), F32)
    return round_to(residual + u, F32), u


def ref_lookahead(acc, u, momentum, chunk_size):
    """Per chunk sum |acc + momentum * u|: the product rounded to float32, then the sum."""
    m = np.float64(np.float32(momentum))
    return ref_norms(round_to(acc + round_to(m * u, F32), F32), chunk_size)


@pytest.mark.parametrize("case", list(LOOKAHEAD_CASES.values()), ids=list(LOOKAHEAD_CASES))
@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16])
def test_accumulate_lookahead_matches_reference(impl, run, case, grad_dtype):
    sizes, chunk_size = case
    tensors, grad = random_tensors(sizes, (grad_dtype,), spread=1.0)
    n = len(grad)
    residual = round_to(RNG.normal(size=n), F32)
    velocity = round_to(RNG.normal(size=n), F32)
    momentum = RNG.uniform(0.5, 0.99)
    acc, norms, new_velocity, lookahead = run(
        lambda r, v: impl.accumulate(r, tensors, chunk_size, v, momentum, lookahead=True),
        tf.constant(residual, F32), tf.constant(velocity, F32))

    expected_acc, u = ref_accumulate(residual, grad, velocity, momentum)
    assert_same(acc, expected_acc)
    assert_same(new_velocity, u)
    assert lookahead.dtype == F32 and lookahead.shape == (ops.num_chunks(n, chunk_size),)
    np.testing.assert_allclose(as_f64(lookahead), ref_lookahead(expected_acc, u, momentum, chunk_size),
                               rtol=2e-6)


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
def test_accumulate_outputs_are_bitwise_the_same_with_and_without_lookahead(impl, case):
    sizes, chunk_size = case
    tensors, grad = random_tensors(sizes, (F32, F64, F16, BF16), spread=1.0)
    n = len(grad)
    residual = tf.constant(round_to(RNG.normal(size=n), F32), F32)
    velocity = tf.constant(round_to(RNG.normal(size=n), F32), F32)
    without = impl.accumulate(residual, tensors, chunk_size, velocity, 0.9)
    with_lookahead = impl.accumulate(residual, tensors, chunk_size, velocity, 0.9, lookahead=True)
    assert len(without) == 3 and len(with_lookahead) == 4
    for plain, fused in zip(without, with_lookahead):
        np.testing.assert_array_equal(bits(fused), bits(plain))


def test_accumulate_lookahead_needs_a_velocity(impl):
    with pytest.raises(ValueError, match="lookahead=True needs a velocity"):
        impl.accumulate(tf.zeros([10]), [tf.zeros([10])], 4, None, 0.9, lookahead=True)


def test_lookahead_on_outputs_larger_than_the_caches_matches_reference():
    """The non-temporal-store path of the compiled vector kernels, with the lookahead norms."""
    if _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    sizes, chunk_size = [3, (16 << 20) // 4 + 1001, 5], 1000
    tensors, grad = random_tensors(sizes, (F32,), spread=1.0)
    n = len(grad)
    residual = round_to(RNG.normal(size=n), F32)
    velocity = round_to(RNG.normal(size=n), F32)
    acc, _, new_velocity, lookahead = ops.compiled.accumulate(
        tf.constant(residual, F32), tensors, chunk_size, tf.constant(velocity, F32), 0.9,
        lookahead=True)
    expected_acc, u = ref_accumulate(residual, grad, velocity, 0.9)
    assert_same(acc, expected_acc)
    assert_same(new_velocity, u)
    np.testing.assert_allclose(as_f64(lookahead), ref_lookahead(expected_acc, u, 0.9, chunk_size),
                               rtol=2e-6)


def random_indices(n, chunk_size, include_last):
    chunks = ops.num_chunks(n, chunk_size)
    if chunks == 0:
        return np.zeros(0, np.int32)
    picked = RNG.random(chunks) < 0.4
    picked[-1] = include_last
    return np.flatnonzero(picked).astype(np.int32)


def chunk_mask(n, chunk_size, indices):
    mask = np.zeros(n, bool)
    for c in indices:
        mask[c * chunk_size:(c + 1) * chunk_size] = True
    return mask


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("include_last", [True, False], ids=["last_chunk", "no_last_chunk"])
def test_gather_and_scatter_match_reference(impl, case, wire, include_last):
    sizes, chunk_size = case
    n = sum(sizes)
    acc = round_to(RNG.normal(size=n) * 10.0, F32)
    velocity = round_to(RNG.normal(size=n), F32)
    indices = random_indices(n, chunk_size, include_last)
    scale = float(RNG.choice([1.0, 0.5, 1.0 / 3.0]))
    mask = chunk_mask(n, chunk_size, indices)

    selected, residual, new_velocity = impl.gather_chunks(
        tf.constant(acc, F32), tf.constant(indices), chunk_size, wire, scale,
        tf.constant(velocity, F32))
    expected_selected = ref_to_wire(acc[mask], F32, wire, scale)
    assert_same(selected, expected_selected)
    assert_same(residual, np.where(mask, 0.0, acc))
    assert_same(new_velocity, np.where(mask, 0.0, velocity))

    shapes = [[s] for s in sizes]
    dtypes = [(F32, F16, F64, BF16)[i % 4] for i in range(len(sizes))]
    outputs = impl.scatter_chunks(selected, tf.constant(indices), chunk_size, shapes, dtypes, 2.0)
    full = np.zeros(n)
    full[mask] = round_to(expected_selected * 2.0, F32)
    offset = 0
    for out, s, dtype in zip(outputs, sizes, dtypes):
        assert out.dtype == dtype and out.shape == (s,)
        assert_same(out, round_to(full[offset:offset + s], dtype))
        offset += s


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
def test_chunk_path_conserves_the_accumulator(impl, case):
    """gathered + residual == acc, exactly, in float32 (FP32 wire, no scale)."""
    sizes, chunk_size = case
    tensors, _ = random_tensors(sizes, (F32, F64))
    n = sum(sizes)
    residual = tf.constant(round_to(RNG.normal(size=n), F32), F32)
    acc, _, _ = impl.accumulate(residual, tensors, chunk_size, None, 0.0)
    indices = tf.constant(random_indices(n, chunk_size, True))
    selected, new_residual, _ = impl.gather_chunks(acc, indices, chunk_size, F32, 1.0, None)
    (gathered,) = impl.scatter_chunks(selected, indices, chunk_size, [[n]], [F32], 1.0)
    assert_same(gathered + new_residual, acc.numpy())
    assert np.all((gathered.numpy() == 0) | (new_residual.numpy() == 0))


def test_gather_no_indices_sends_nothing(impl):
    acc = tf.constant(RNG.normal(size=50), F32)
    selected, residual, velocity = impl.gather_chunks(acc, tf.zeros([0], tf.int32), 8, F16, 1.0, None)
    assert selected.shape == (0,) and velocity is None
    assert_same(residual, acc.numpy())


def test_outputs_larger_than_the_caches_match_reference():
    """Outputs of >= 16 MB take the non-temporal-store path of the compiled vector kernels."""
    if _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    impl = ops.compiled
    sizes, chunk_size = [3, (16 << 20) // 4 + 1001, 5], 1000
    tensors, grad = random_tensors(sizes, (F32,), spread=1.0)
    n = len(grad)
    shapes, dtypes = [[s] for s in sizes], [F32] * 3
    wire, wire_values = make_tensor(grad, F16)
    unpacked = impl.unpack(wire, shapes, dtypes, 3.0)
    assert_same(tf.concat(unpacked, 0), ref_from_wire(wire_values, F32, 3.0))

    residual = round_to(RNG.normal(size=n), F32)
    velocity = round_to(RNG.normal(size=n), F32)
    acc, norms, new_velocity = impl.accumulate(tf.constant(residual, F32), tensors, chunk_size,
                                               tf.constant(velocity, F32), 0.5)
    u = round_to(round_to(0.5 * velocity, F32) + grad, F32)
    expected_acc = round_to(residual + u, F32)
    assert_same(acc, expected_acc)
    assert_same(new_velocity, u)
    np.testing.assert_allclose(as_f64(norms), ref_norms(expected_acc, chunk_size), rtol=2e-6)

    indices = random_indices(n, chunk_size, True)
    mask = chunk_mask(n, chunk_size, indices)
    selected, new_residual, _ = impl.gather_chunks(acc, tf.constant(indices), chunk_size, F32, 1.0, None)
    assert_same(selected, expected_acc[mask])
    assert_same(new_residual, np.where(mask, 0.0, expected_acc))
    scattered = impl.scatter_chunks(selected, tf.constant(indices), chunk_size, shapes, dtypes, 1.0)
    assert_same(tf.concat(scattered, 0), np.where(mask, expected_acc, 0.0))


# ---------------------------------------------------------------------------
# Run-time scales: a Python float, a float32 scalar tensor, or one float32
# scale per tensor (pack, unpack) / per selected chunk (gather, scatter).
# ---------------------------------------------------------------------------

@pytest.fixture(params=["eager", "tf_function"])
def run(request):
    """run(fn, *args): fn(*args) eagerly, or through a fresh tf.function (tensor args are graph inputs)."""
    if request.param == "eager":
        return lambda fn, *args: fn(*args)
    return lambda fn, *args: tf.function(fn)(*args)


SCALE_KINDS = ["python_float", "scalar_tensor", "vector_tensor"]


def random_scales(count):
    """float32 [count]: mostly powers of two in [2^-24, 2^40], some arbitrary values of either sign."""
    powers = 2.0 ** RNG.integers(-24, 41, count)
    return np.where(RNG.random(count) < 0.7, powers, RNG.uniform(-3.0, 3.0, count)).astype(np.float32)


def scale_argument(kind, count):
    """(the `scale` to pass, float64 [count]: the scale of each item)."""
    values = random_scales(count if kind == "vector_tensor" else 1)
    per_item = np.resize(values, count).astype(np.float64)
    if kind == "python_float":
        return float(values[0]), per_item
    if kind == "scalar_tensor":
        return tf.constant(values[0]), per_item
    return tf.constant(values), per_item


def segments(flat, sizes):
    offsets = np.cumsum([0] + list(sizes))
    return [flat[b:e] for b, e in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("sizes", list(SIZE_CASES.values()), ids=list(SIZE_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_pack_with_runtime_scales_matches_reference(impl, run, sizes, wire, kind):
    tensors, flat = random_tensors(sizes, GRAD_DTYPES, spread=2.0)
    scale, per_tensor = scale_argument(kind, len(tensors))
    packed = run(lambda ts, s: impl.pack(ts, wire, s), tensors, scale)
    assert packed.dtype == wire and packed.shape == (len(flat),)
    expected = [ref_to_wire(part, t.dtype, wire, k)
                for part, t, k in zip(segments(flat, sizes), tensors, per_tensor)]
    assert_same(packed, np.concatenate(expected) if expected else [])


@pytest.mark.parametrize("sizes", list(SIZE_CASES.values()), ids=list(SIZE_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_unpack_with_runtime_scales_matches_reference(impl, run, sizes, wire, kind):
    wire_values = round_to(RNG.normal(size=sum(sizes)) * 100.0, wire)
    wire_values = np.where(np.abs(wire_values) < 1e-30, 1.0, wire_values)  # no bf16 subnormals
    wire_tensor = make_tensor(wire_values, wire)[0]
    shapes = [[n] if n % 2 or n == 0 else [2, n // 2] for n in sizes]
    dtypes = [GRAD_DTYPES[i % 4] for i in range(len(sizes))]
    scale, per_output = scale_argument(kind, len(sizes))
    outputs = run(lambda b, s: impl.unpack(b, shapes, dtypes, s), wire_tensor, scale)
    assert len(outputs) == len(sizes)
    for out, shape, dtype, part, k in zip(outputs, shapes, dtypes, segments(wire_values, sizes),
                                          per_output):
        assert out.dtype == dtype and out.shape.as_list() == shape
        assert_same(tf.reshape(out, [-1]), ref_from_wire(part, dtype, k))


def chunk_element_scales(n, chunk_size, indices, per_chunk):
    """float64 [elements in the chunks `indices`]: each element's scale, in selected order."""
    lengths = [min(chunk_size, n - c * chunk_size) for c in indices]
    return np.repeat(np.asarray(per_chunk, np.float64), lengths)


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_gather_chunks_with_runtime_scales_matches_reference(impl, run, case, wire, kind):
    sizes, chunk_size = case
    n = sum(sizes)
    acc = round_to(RNG.normal(size=n) * 10.0, F32)
    velocity = round_to(RNG.normal(size=n), F32)
    indices = random_indices(n, chunk_size, include_last=bool(RNG.integers(2)))
    mask = chunk_mask(n, chunk_size, indices)
    scale, per_chunk = scale_argument(kind, len(indices))
    selected, residual, new_velocity = run(
        lambda a, i, s, v: impl.gather_chunks(a, i, chunk_size, wire, s, v),
        tf.constant(acc, F32), tf.constant(indices), scale, tf.constant(velocity, F32))
    element_scales = chunk_element_scales(n, chunk_size, indices, per_chunk)
    assert_same(selected, ref_to_wire(acc[mask], F32, wire, element_scales))
    assert_same(residual, np.where(mask, 0.0, acc))
    assert_same(new_velocity, np.where(mask, 0.0, velocity))


@pytest.mark.parametrize("case", list(CHUNK_CASES.values()), ids=list(CHUNK_CASES))
@pytest.mark.parametrize("wire", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_scatter_chunks_with_runtime_scales_matches_reference(impl, run, case, wire, kind):
    sizes, chunk_size = case
    n = sum(sizes)
    indices = random_indices(n, chunk_size, include_last=bool(RNG.integers(2)))
    mask = chunk_mask(n, chunk_size, indices)
    wire_values = round_to(RNG.normal(size=int(mask.sum())) * 100.0, wire)
    wire_values = np.where(np.abs(wire_values) < 1e-30, 1.0, wire_values)  # no bf16 subnormals
    scale, per_chunk = scale_argument(kind, len(indices))
    shapes = [[s] for s in sizes]
    dtypes = [(F32, F16, F64, BF16)[i % 4] for i in range(len(sizes))]
    outputs = run(lambda sel, i, s: impl.scatter_chunks(sel, i, chunk_size, shapes, dtypes, s),
                  make_tensor(wire_values, wire)[0], tf.constant(indices), scale)
    full = np.zeros(n)
    full[mask] = ref_from_wire(wire_values, F32, chunk_element_scales(n, chunk_size, indices, per_chunk))
    for out, part, dtype in zip(outputs, segments(full, sizes), dtypes):
        assert out.dtype == dtype
        assert_same(out, round_to(part, dtype))


# Values v and power-of-two scales 2^k with v * 2^k at the edges of FP16's range.
FP16_EDGES = [  # (value, k, v * 2^k in FP16)
    (65504.0 * 2.0 ** -40, 40, 65504.0),               # the largest finite value, exactly
    (65519.0 * 2.0 ** -30, 30, 65504.0),               # rounds down to it
    (65520.0 * 2.0 ** -20, 20, np.inf),                # the halfway point rounds to inf
    (-1e6 * 2.0 ** 10, -10, -np.inf),                  # beyond the range
    (2.0 ** -24 * 2.0 ** 24, -24, 2.0 ** -24),         # the smallest subnormal
    (3.0 * 2.0 ** -26 * 2.0 ** 24, -24, 2.0 ** -24),   # rounds up to it
    (2.0 ** -25 * 2.0 ** 24, -24, 0.0),                # half of it: tie to even, 0
    (-1000.5 * 2.0 ** -10, 10, -1000.5),               # an ordinary value, exactly
    (np.nan, -24, np.nan),
    (np.inf, 40, np.inf),
]


def fp16_edge_expectation():
    values = np.array([v for v, _, _ in FP16_EDGES])
    scales = np.array([2.0 ** k for _, k, _ in FP16_EDGES], np.float32)
    expected = round_to(values * scales.astype(np.float64), F16)  # exact products, one rounding
    np.testing.assert_array_equal(expected, [e for _, _, e in FP16_EDGES])
    return values, scales, expected


def test_pack_power_of_two_scales_at_fp16_limits(impl):
    values, scales, expected = fp16_edge_expectation()
    for dtype in (F32, F64):
        tensors = [tf.constant([v], dtype) for v in values]
        assert_same(impl.pack(tensors, F16, tf.constant(scales)), expected)
    # The same values in one tensor of 37 (vector body and tail) with one scale each.
    for v, k, e in zip(values, scales, expected):
        assert_same(impl.pack([tf.constant(np.full(37, v), F32)], F16, float(k)), np.full(37, e))


def test_gather_chunks_power_of_two_scales_at_fp16_limits(impl):
    values, scales, expected = fp16_edge_expectation()
    chunk_size = 7  # one value per chunk, repeated; the last chunk partial
    n = chunk_size * len(values) - 3
    acc = np.repeat(values, chunk_size)[:n]
    indices = np.arange(len(values), dtype=np.int32)
    selected, _, _ = impl.gather_chunks(tf.constant(acc, F32), tf.constant(indices), chunk_size,
                                        F16, tf.constant(scales), None)
    assert_same(selected, np.repeat(expected, chunk_size)[:n])


def bits(t):
    array = t.numpy()
    return array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


@pytest.mark.parametrize("k", [-24, 40, None], ids=["2^-24", "2^40", "random_powers"])
def test_power_of_two_scales_round_trip_bitwise_on_a_float32_wire(impl, k):
    """x * 2^k on the wire, then * 2^-k, gives x back bit for bit: the scales are exact."""
    sizes = [1009, 7, 1, 0, 40]
    tensors, flat = random_tensors(sizes, (F32,), spread=3.0)
    flat[:6] = [-0.0, np.nan, np.inf, -np.inf, 1e-3, -1e3]
    tensors[0] = tf.constant(flat[:1009].astype(np.float32))
    exponents = RNG.integers(-24, 41, len(sizes)) if k is None else np.full(len(sizes), k)
    up = tf.constant(2.0 ** exponents, F32)
    down = tf.constant(2.0 ** -exponents, F32)
    packed = impl.pack(tensors, F32, up)
    restored = impl.unpack(packed, [t.shape for t in tensors], [F32] * len(sizes), down)
    for t, r in zip(tensors, restored):
        np.testing.assert_array_equal(bits(r), bits(t))

    n, chunk_size = len(flat), 100
    acc = tf.constant(flat.astype(np.float32))
    indices = random_indices(n, chunk_size, include_last=True)
    exponents = RNG.integers(-24, 41, len(indices)) if k is None else np.full(len(indices), k)
    selected, _, _ = impl.gather_chunks(acc, tf.constant(indices), chunk_size, F32,
                                        tf.constant(2.0 ** exponents, F32), None)
    (scattered,) = impl.scatter_chunks(selected, tf.constant(indices), chunk_size, [[n]], [F32],
                                       tf.constant(2.0 ** -exponents, F32))
    mask = chunk_mask(n, chunk_size, indices)
    np.testing.assert_array_equal(bits(scattered)[mask], bits(acc)[mask])
    np.testing.assert_array_equal(bits(scattered)[~mask], 0)  # +0.0


def test_scales_accept_lists_and_numpy_arrays(impl):
    tensors = [tf.constant([1.0, 3.0]), tf.constant([5.0], F64)]
    for scale in ([0.5, 4.0], np.array([0.5, 4.0]), (0.5, 4.0), np.float32(0.5)):
        expected = [0.5, 1.5, 20.0 if np.ndim(scale) else 2.5]
        assert_same(impl.pack(tensors, F16, scale), expected)
        assert_same(tf.concat([tf.cast(o, F64) for o in impl.unpack(
            tf.constant([1.0, 3.0, 5.0], F16), [[2], [1]], [F32, F64], scale)], 0), expected)


def test_runtime_scales_of_unknown_shape_match_known(impl):
    """Scale tensors whose shape is known only at run time (input_signature) give the same results."""
    tensors, _ = random_tensors([1009, 7, 1], (F32, F64))
    shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
    acc = tf.constant(RNG.normal(size=1017) * 10.0, F32)
    indices = tf.constant([0, 3, 10], tf.int32)
    any_scale = tf.TensorSpec(None, F32)

    def step(pack_scale, chunk_scale, indices):
        packed = impl.pack(tensors, F16, pack_scale)
        unpacked = impl.unpack(packed, shapes, dtypes, pack_scale)
        selected, _, _ = impl.gather_chunks(acc, indices, 100, BF16, chunk_scale, None)
        scattered = impl.scatter_chunks(selected, indices, 100, shapes, dtypes, chunk_scale)
        return [packed, selected] + unpacked + scattered

    dynamic = tf.function(step, input_signature=[any_scale, any_scale, tf.TensorSpec([None], tf.int32)])
    for pack_scale, chunk_scale in [(random_scales(3), random_scales(3)),
                                    (random_scales(1)[0], random_scales(1)[0])]:
        pack_scale, chunk_scale = tf.constant(pack_scale), tf.constant(chunk_scale)
        for got, want in zip(dynamic(pack_scale, chunk_scale, indices),
                             step(pack_scale, chunk_scale, indices)):
            assert_same(got, as_f64(want))


@pytest.mark.parametrize("indices", [[], [10], [0, 3], [1, 2, 4, 7, 10]],
                         ids=["none", "only_the_partial_last", "two", "five"])
def test_chunk_ops_take_indices_of_run_time_length(impl, indices):
    """ChunkSparsity(selection="global") gives each pack a share of the K chunks whose
    length is known only at run time, possibly 0: gather and scatter traced with
    indices [None] and per-chunk scales [None] match the reference, velocity included."""
    sizes, chunk_size = [1000, 1], 100           # 11 chunks, the last of 1 element
    n = sum(sizes)
    acc = round_to(RNG.normal(size=n) * 10.0, F32)
    velocity = round_to(RNG.normal(size=n), F32)
    per_chunk = 2.0 ** RNG.integers(-8, 9, len(indices)).astype(np.float32)
    shapes, dtypes = [[s] for s in sizes], [F32, BF16]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], F32)])
    def step(idx, scale):
        selected, residual, new_velocity = impl.gather_chunks(
            tf.constant(acc, F32), idx, chunk_size, F16, scale, tf.constant(velocity, F32))
        outputs = impl.scatter_chunks(selected, idx, chunk_size, shapes, dtypes, 1.0 / scale)
        return [selected, residual, new_velocity] + outputs

    selected, residual, new_velocity, *outputs = step(
        tf.constant(indices, tf.int32), tf.constant(per_chunk, F32))
    mask = chunk_mask(n, chunk_size, indices)
    element_scales = chunk_element_scales(n, chunk_size, indices, per_chunk)
    expected = ref_to_wire(acc[mask], F32, F16, element_scales)
    assert_same(selected, expected)
    assert_same(residual, np.where(mask, 0.0, acc))
    assert_same(new_velocity, np.where(mask, 0.0, velocity))
    full = np.zeros(n)
    full[mask] = ref_from_wire(expected, F32, 1.0 / element_scales.astype(np.float32))
    for out, part, dtype in zip(outputs, segments(full, sizes), dtypes):
        assert out.dtype == dtype
        assert_same(out, round_to(part, dtype))


# ---------------------------------------------------------------------------
# abs_max
# ---------------------------------------------------------------------------

def tensor_from_bits(raw, dtype):
    """(tensor of `dtype` with exactly these bit patterns, their float64 values)."""
    int_dtype = {F16: np.uint16, BF16: np.uint16, F32: np.uint32, F64: np.uint64}[dtype]
    raw = np.asarray(raw, int_dtype)
    signed = {2: tf.int16, 4: tf.int32, 8: tf.int64}[raw.dtype.itemsize]
    tensor = tf.bitcast(tf.constant(raw.view(signed.as_numpy_dtype)), dtype)
    if dtype == BF16:
        values = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        values = raw.view({F16: np.float16, F32: np.float32, F64: np.float64}[dtype]).astype(np.float64)
    return tensor, values


def random_bits(n, dtype):
    """Random bit patterns of `dtype` as uint64: every exponent equally likely (subnormals,
    inf and NaN included)."""
    width = {F16: 16, BF16: 16, F32: 32, F64: 64}[dtype]
    return RNG.integers(0, 2 ** width - 1, n, dtype=np.uint64, endpoint=True)


def ref_abs_max(values):
    """float64 reference: max |v| (0 if empty; NaN if any NaN), rounded to float32."""
    if values.size == 0:
        return 0.0
    if np.isnan(values).any():
        return np.nan
    with np.errstate(over="ignore"):
        return float(np.float32(np.max(np.abs(values))))


def finite_bits(n, dtype, exponent_bits):
    """Random finite, non-NaN bit patterns (random sign, exponent below all ones)."""
    raw = random_bits(n, dtype)
    width = {F16: 16, BF16: 16, F32: 32, F64: 64}[dtype]
    all_ones = ((1 << exponent_bits) - 1) << (width - 1 - exponent_bits)
    raw = raw.astype(np.uint64)
    is_special = (raw & np.uint64(all_ones)) == np.uint64(all_ones)
    return np.where(is_special, raw & ~np.uint64(1 << (width - 2)), raw)


EXPONENT_BITS = {F16: 5, BF16: 8, F32: 8, F64: 11}


@pytest.mark.parametrize("sizes", [[], [0], [1, 7, 1009, 0, 40000, 100003, 70001, 33000], [3] * 40],
                         ids=["no_tensors", "empty", "mixed_sizes", "many_tensors"])
def test_abs_max_matches_reference(impl, run, sizes):
    """Random bit patterns of every finite magnitude (subnormals included) in tensors of every
    dtype, large ones spanning several parallel shards."""
    tensors, expected = [], []
    for i, n in enumerate(sizes):
        dtype = GRAD_DTYPES[(i + 1) % 4]
        if dtype == F64:  # maxima that float32 represents as normal numbers or inf (see abs_max)
            values = RNG.normal(size=n) * 10.0 ** RNG.uniform(-30, 60, n)
            t, exact = tf.constant(values, F64), values
        else:
            t, exact = tensor_from_bits(finite_bits(n, dtype, EXPONENT_BITS[dtype]), dtype)
        tensors.append(tf.reshape(t, [n] if n % 2 else [n // 2, 2] if n else [0, 3]))
        expected.append(ref_abs_max(exact))
    got = run(impl.abs_max, tensors)
    assert got.dtype == F32 and got.shape == (len(sizes),)
    assert_same(got, expected)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("length", [1, 7, 37, 1009], ids=lambda n: f"n{n}")
def test_abs_max_special_values(impl, dtype, length):
    def case(values):
        values = np.asarray(values, np.float64)
        if dtype == BF16:
            t = tf.cast(tf.constant(values.astype(np.float32)), BF16)  # normal values: exact
        else:
            t = tf.constant(values, dtype)
        return t

    position = int(RNG.integers(length))  # vector body or tail
    base = np.where(np.arange(length) % 2, -1.0, 0.5) * 3.0
    cases = []
    for special, want in [(np.nan, np.nan), (np.inf, np.inf), (-np.inf, np.inf), (-7.0, 7.0)]:
        values = base.copy()
        values[position] = special
        cases.append((case(values), want))
    with_both = base.copy()
    with_both[position] = -np.inf
    with_both[(position + length // 2) % length] = np.nan
    cases.append((case(with_both), np.nan))
    cases.append((case(np.full(length, -0.0)), 0.0))
    got = impl.abs_max([t for t, _ in cases])
    assert_same(got, [w for _, w in cases])
    assert not np.signbit(got.numpy()[-1])  # max |-0.0| is +0.0


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: d.name)
def test_abs_max_of_subnormals_is_exact(impl, dtype):
    """Subnormal maxima come back exactly (TF's own max reads them as 0: denormals-are-zero)."""
    mantissa_bits = {F16: 10, BF16: 7, F32: 23}[dtype]
    raw = RNG.integers(1, 2 ** mantissa_bits, 1009)  # exponent 0: subnormal
    raw[::3] |= 1 << 15 if dtype != F32 else 1 << 31  # negative ones too
    t, values = tensor_from_bits(raw, dtype)
    assert_same(impl.abs_max([t, t[:1], t[:7]]),
                [ref_abs_max(values), ref_abs_max(values[:1]), ref_abs_max(values[:7])])
    assert 0 < impl.abs_max([t]).numpy()[0] < 2.0 ** -14


def test_abs_max_rounds_float64_to_nearest_float32(impl):
    above_max = float(np.finfo(np.float32).max) * (1 + 2.0 ** -20)
    just_above_one = 1.0 + 2.0 ** -30
    values = [[just_above_one, -0.5], [-above_max], [1e300, 2.0], [np.nan, np.inf]]
    got = impl.abs_max([tf.constant(v, F64) for v in values])
    assert_same(got, [1.0, np.inf, np.inf, np.nan])


# ---------------------------------------------------------------------------
# tf.function, XLA and implementation selection
# ---------------------------------------------------------------------------

def test_every_op_inside_tf_function_matches_eager(impl):
    tensors, _ = random_tensors([1009, 7, 1], (F32, F64))
    shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
    residual = tf.constant(RNG.normal(size=1017), F32)
    velocity = tf.constant(RNG.normal(size=1017), F32)
    indices = tf.constant([0, 3, 10], tf.int32)

    def step(tensors, residual, velocity):
        packed = impl.pack(tensors, F16, 0.5)
        unpacked = impl.unpack(packed, shapes, dtypes, 2.0)
        # Inside the function, acc and the new velocity feed only the gather, which
        # may then update them in place (it cannot eagerly: Python holds them).
        acc, norms, new_velocity = impl.accumulate(residual, unpacked, 100, velocity, 0.9)
        selected, new_residual, masked_velocity = impl.gather_chunks(
            acc, indices, 100, BF16, 0.5, new_velocity)
        scattered = impl.scatter_chunks(selected, indices, 100, shapes, dtypes, 2.0)
        return [packed, norms, selected, new_residual, masked_velocity] + unpacked + scattered

    eager = step(tensors, residual, velocity)
    traced = tf.function(step)(tensors, residual, velocity)
    for e, t in zip(eager, traced):
        assert_same(t, as_f64(e))


def _graph_op_types(fn, *args):
    return {op.type for op in fn.get_concrete_function(*args).graph.get_operations()}


def test_public_functions_use_the_compiled_ops_on_cpu():
    if _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    assert ops.library_status().startswith("compiled (")
    x = tf.constant(RNG.normal(size=100), F32)
    fn = tf.function(lambda x: ops.unpack(ops.pack([x], F16, 0.5), [[100]], [F32], 2.0))
    assert {"GfPack", "GfUnpack"} <= _graph_op_types(fn, x)
    assert "GfAbsMax" in _graph_op_types(tf.function(lambda x: ops.abs_max([x])), x)


def test_public_functions_fall_back_to_composite_under_xla():
    x = tf.constant(RNG.normal(size=100), F32)
    indices = tf.constant([1, 4], tf.int32)

    def step(x):
        acc, norms, _ = ops.accumulate(tf.zeros([100]), [x], 16, None, 0.0)
        selected, residual, _ = ops.gather_chunks(acc, indices, 16, F16, 1.0, None)
        return [ops.pack([x], F16, 1.0), norms, residual] + ops.scatter_chunks(
            selected, indices, 16, [[100]], [F32], 1.0)

    xla = tf.function(step, jit_compile=True)
    assert not any(t.startswith("Gf") for t in _graph_op_types(xla, x))
    for got, want in zip(xla(x), step(x)):
        np.testing.assert_allclose(as_f64(got), as_f64(want), rtol=1e-6)


def test_runtime_scales_and_abs_max_under_xla_match_eager():
    tensors, _ = random_tensors([1009, 7, 1], (F32, F64, F16))
    shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
    acc = tf.constant(RNG.normal(size=1017) * 10.0, F32)
    indices = tf.constant([0, 3, 10], tf.int32)

    def step(tensors, pack_scale, chunk_scale):
        packed = ops.pack(tensors, F16, pack_scale)
        selected, residual, _ = ops.gather_chunks(acc, indices, 100, F16, chunk_scale, None)
        return ([ops.abs_max(tensors), packed, selected, residual]
                + ops.unpack(packed, shapes, dtypes, pack_scale)
                + ops.scatter_chunks(selected, indices, 100, shapes, dtypes, chunk_scale))

    pack_scale, chunk_scale = tf.constant(random_scales(3)), tf.constant(random_scales(3))
    xla = tf.function(step, jit_compile=True)
    assert not any(t.startswith("Gf") for t in _graph_op_types(xla, tensors, pack_scale, chunk_scale))
    for got, want in zip(xla(tensors, pack_scale, chunk_scale), step(tensors, pack_scale, chunk_scale)):
        assert_same(got, as_f64(want))


def test_public_functions_use_composite_for_gpu_tensors():
    x = tf.constant(RNG.normal(size=100), F32)

    def step(x):
        # Soft placement runs this on the CPU here; the choice is made at trace time from devices.
        with tf.device("/GPU:0"):
            return ops.unpack(ops.pack([tf.identity(x)], F16, 0.5), [[100]], [F32], 2.0)

    traced = tf.function(step)
    assert not any(t.startswith("Gf") for t in _graph_op_types(traced, x))
    (got,) = traced(x)
    np.testing.assert_allclose(as_f64(got), round_to(x.numpy().astype(np.float64) * 0.5, F16) * 2.0)


@pytest.fixture
def fresh_library_state(monkeypatch):
    """A not-yet-loaded library state, restored after the test."""
    monkeypatch.setattr(_library, "_library", _library._Library())
    return monkeypatch


def test_unbuilt_library_warns_once_and_falls_back(fresh_library_state, tmp_path):
    fresh_library_state.setenv(ops.LIBRARY_ENV, str(tmp_path / "missing" / "_gf_tf_ops.so"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = ops.pack([tf.constant([1.0, 65520.0])], F16, 1.0)
        ops.pack([tf.constant([2.0])], F16, 1.0)
    assert_same(packed, [1.0, np.inf])
    messages = [str(w.message) for w in caught if "gf_tf" in str(w.message)]
    assert len(messages) == 1, messages
    assert "not built" in messages[0] and "pip install" in messages[0]
    assert ops.library_status().startswith("composite (compiled ops library not built")
    with pytest.raises(RuntimeError, match="unavailable"):
        ops.compiled.pack([tf.constant([1.0])], F16, 1.0)


def test_library_built_for_another_tensorflow_warns_and_falls_back(fresh_library_state, tmp_path):
    library = tmp_path / "_gf_tf_ops.so"
    library.write_bytes(b"not loaded: the version check comes first")
    (tmp_path / "_gf_tf_ops.tf_version").write_text("2.0.0\n")
    fresh_library_state.setenv(ops.LIBRARY_ENV, str(library))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = ops.pack([tf.constant([3.0])], F16, 0.5)
    assert_same(packed, [1.5])
    (message,) = [str(w.message) for w in caught if "gf_tf" in str(w.message)]
    assert "2.0.0" in message and tf.__version__ in message and "pip install" in message


def test_unloadable_library_warns_and_falls_back(fresh_library_state, tmp_path):
    library = tmp_path / "_gf_tf_ops.so"
    library.write_bytes(b"this is not a shared object")
    fresh_library_state.setenv(ops.LIBRARY_ENV, str(library))
    with pytest.warns(RuntimeWarning, match=r"failed to load .*pip install"):
        assert ops.library_status().startswith("composite (")


# ---------------------------------------------------------------------------
# Bad input: errors name the problem.
# ---------------------------------------------------------------------------

BAD_INPUT_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_rejects_chunk_size_below_one(impl, chunk_size):
    acc = tf.zeros([10])
    with pytest.raises(BAD_INPUT_ERRORS, match=f"chunk_size must be >= 1 element, got {chunk_size}"):
        impl.accumulate(acc, [tf.zeros([10])], chunk_size, None, 0.0)
    with pytest.raises(BAD_INPUT_ERRORS, match="chunk_size must be >= 1"):
        impl.gather_chunks(acc, tf.constant([0]), chunk_size, F16, 1.0, None)
    with pytest.raises(BAD_INPUT_ERRORS, match="chunk_size must be >= 1"):
        impl.scatter_chunks(tf.zeros([0], F16), tf.zeros([0], tf.int32), chunk_size, [[10]], [F32], 1.0)


@pytest.mark.parametrize("indices, problem", [
    ([0, 11], "out of range"),        # 1001 elements in chunks of 100: 11 chunks
    ([-1, 2], "out of range|>= 0"),
    ([3, 1], "sorted ascending without duplicates"),
    ([2, 2], "sorted ascending without duplicates"),
], ids=["past_end", "negative", "unsorted", "duplicate"])
def test_rejects_bad_chunk_indices(impl, indices, problem):
    acc = tf.zeros([1001])
    with pytest.raises(BAD_INPUT_ERRORS, match=problem):
        impl.gather_chunks(acc, tf.constant(indices, tf.int32), 100, F16, 1.0, None)
    with pytest.raises(BAD_INPUT_ERRORS, match=problem):
        impl.scatter_chunks(tf.zeros([200], F16), tf.constant(indices, tf.int32), 100,
                            [[1001]], [F32], 1.0)


def test_rejects_size_mismatches(impl):
    with pytest.raises(BAD_INPUT_ERRORS, match=r"(?s)elements.*(1000|expected)"):
        impl.accumulate(tf.zeros([1000]), [tf.zeros([999])], 10, None, 0.0)
    with pytest.raises(BAD_INPUT_ERRORS, match="elements"):
        impl.unpack(tf.zeros([5], F16), [[2], [2]], [F32, F32], 1.0)
    with pytest.raises(BAD_INPUT_ERRORS, match="selected"):
        impl.scatter_chunks(tf.zeros([7], F16), tf.constant([0, 1]), 4, [[10]], [F32], 1.0)


def test_kernels_check_sizes_known_only_at_run_time(impl):
    @tf.function(input_signature=[tf.TensorSpec([None], F16)])
    def unpack_dynamic(buffer):
        return impl.unpack(buffer, [[2], [2]], [F32, F32], 1.0)

    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)5.*4|must match"):
        unpack_dynamic(tf.zeros([5], F16))


def test_rejects_non_floating_tensors_and_wire_types(impl):
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype int32"):
        impl.pack([tf.zeros([2]), tf.zeros([2], tf.int32)], F16, 1.0)
    with pytest.raises(ValueError, match="wire_dtype must be float16, bfloat16 or float32"):
        impl.pack([tf.zeros([2])], tf.int8, 1.0)


@pytest.mark.parametrize("bad_shape", [[2], [4], [1, 3]], ids=["short", "long", "matrix"])
def test_rejects_scales_of_the_wrong_shape(impl, bad_shape):
    """One scale per tensor (pack: 3 inputs, unpack: 3 outputs) or per selected chunk (3 indices)."""
    got = re.escape("[" + ",".join(map(str, bad_shape)) + "]")
    tensors = [tf.zeros([2]), tf.zeros([1]), tf.zeros([0])]
    indices = tf.constant([0, 2, 4], tf.int32)
    scale = tf.ones(bad_shape)

    def message(op, items):
        return rf"{op}: scale must have shape \[\] or \[3\] \({items}\), got {got}"

    per_chunk = r"one scale per selected chunk, k = len\(indices\)"
    with pytest.raises(ValueError, match=message("pack", "one scale per input tensor")):
        impl.pack(tensors, F16, scale)
    with pytest.raises(ValueError, match=message("unpack", "one scale per output tensor")):
        impl.unpack(tf.zeros([3], F16), [[2], [1], [0]], [F32] * 3, scale)
    with pytest.raises(ValueError, match=message("gather_chunks", per_chunk)):
        impl.gather_chunks(tf.zeros([50]), indices, 10, F16, scale, None)
    with pytest.raises(ValueError, match=message("scatter_chunks", per_chunk)):
        impl.scatter_chunks(tf.zeros([30], F16), indices, 10, [[50]], [F32], scale)


@pytest.mark.parametrize("bad_shape", [[2], [4], [0], [1, 3]], ids=["short", "long", "empty", "matrix"])
def test_rejects_scales_of_the_wrong_shape_known_only_at_run_time(impl, bad_shape):
    any_scale = tf.TensorSpec(None, F32)
    tensors = [tf.zeros([2]), tf.zeros([1]), tf.zeros([0])]
    # The kernels name the op and the count; the composite's run-time check, the Python name and k.
    calls = {
        r"(GfPack|pack): scale must have shape \[\] or \[3\] \(one scale per input tensor\)":
            lambda s, i: impl.pack(tensors, F16, s),
        r"(GfUnpack|unpack): scale must have shape \[\] or \[3\] \(one scale per output tensor\)":
            lambda s, i: impl.unpack(tf.zeros([3], F16), [[2], [1], [0]], [F32] * 3, s),
        r"(GfGatherChunks|gather_chunks): scale must have shape \[\] or \[(3|k)\] \(one scale per":
            lambda s, i: impl.gather_chunks(tf.zeros([50]), i, 10, F16, s, None)[0],
        r"(GfScatterChunks|scatter_chunks): scale must have shape \[\] or \[(3|k)\] \(one scale per":
            lambda s, i: impl.scatter_chunks(tf.zeros([30], F16), i, 10, [[50]], [F32], s),
    }
    for message, call in calls.items():
        fn = tf.function(call, input_signature=[any_scale, tf.TensorSpec([None], tf.int32)])
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            fn(tf.ones(bad_shape), tf.constant([0, 2, 4], tf.int32))


def test_shape_functions_check_the_scale_rank():
    """The registered ops reject a statically wrong scale while the graph is built."""
    lib = _library.load()
    if lib is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    bad, indices = tf.ones([2]), tf.constant([0, 2, 4], tf.int32)
    calls = {
        r"GfPack: scale must have shape \[\] or \[3\] .*got \[2\]":
            lambda: lib.gf_pack([tf.zeros([2]), tf.zeros([1]), tf.zeros([1])], bad, wire_dtype=F16),
        r"GfUnpack: scale must have shape \[\] or \[3\] .*got \[2\]":
            lambda: lib.gf_unpack(tf.zeros([3], F16), bad, Tout=[F32] * 3, shapes=[[1]] * 3),
        r"GfGatherChunks: scale must have shape \[\] or \[3\] .*got \[2\]":
            lambda: lib.gf_gather_chunks(tf.zeros([50]), indices, bad, [], chunk_size=10, wire_dtype=F16),
        r"GfScatterChunks: scale must have shape \[\] or \[3\] .*got \[1,3\]":
            lambda: lib.gf_scatter_chunks(tf.zeros([30], F16), indices, tf.ones([1, 3]), chunk_size=10,
                                          Tout=[F32], shapes=[[50]]),
    }
    for message, call in calls.items():
        with pytest.raises(ValueError, match=message):
            tf.function(call).get_concrete_function()


def test_rejects_scale_tensors_not_float32(impl):
    with pytest.raises(TypeError, match="scale must be float32, got float64; cast it"):
        impl.pack([tf.zeros([2])], F16, tf.constant(0.5, F64))
    with pytest.raises(TypeError, match="scale must be float32, got int32"):
        impl.scatter_chunks(tf.zeros([10], F16), tf.constant([0]), 10, [[10]], [F32], tf.constant([2]))


# ---------------------------------------------------------------------------
# Indices and lengths read from tensors: the kernels validate them before
# touching a buffer. Run under AddressSanitizer (nox -s asan), a
# missing check is an out-of-bounds access, not just a wrong message. Traced
# with unknown shapes where gf_tf.ops would check a static shape first, so the
# kernel's OP_REQUIRES is what answers.
# ---------------------------------------------------------------------------

@pytest.fixture(params=["compiled", "compiled_scalar"])
def kernels(request):
    if _library.load() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    return IMPLEMENTATIONS[request.param]


def _run_time(fn, *specs):
    """fn traced with inputs of unknown length (tf.TensorSpec([None], dtype) per dtype)."""
    return tf.function(fn, input_signature=[tf.TensorSpec([None], d) for d in specs])


BAD_INDICES = {   # 1001 elements in chunks of 100: chunks 0..10
    "past_end": ([0, 11], r"indices\[1\] = 11 is out of range \[0, 11\)"),
    "far_past_end": ([3, 2 ** 31 - 1], r"indices\[1\] = 2147483647 is out of range \[0, 11\)"),
    "negative": ([-1, 2], r"indices\[0\] = -1 is out of range \[0, 11\)"),
    "most_negative": ([-2 ** 31], r"indices\[0\] = -2147483648 is out of range \[0, 11\)"),
}


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", list(BAD_INDICES), ids=list(BAD_INDICES))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "run_time_length"])
def test_chunk_kernels_reject_out_of_range_indices_naming_the_value(kernels, index_dtype, case, traced):
    indices, message = BAD_INDICES[case]
    acc, velocity = tf.zeros([1001]), tf.zeros([1001])

    def gather(idx):
        return kernels.gather_chunks(acc, idx, 100, F16, 1.0, velocity)[0]

    def scatter(idx):
        return kernels.scatter_chunks(tf.zeros([200], F16), idx, 100, [[1000], [1]], [F32, F16], 1.0)

    for op, fn in (("gather_chunks", gather), ("scatter_chunks", scatter)):
        call = _run_time(fn, index_dtype) if traced else fn
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"{op}: {message}"):
            call(tf.constant(indices, index_dtype))


def test_chunk_kernels_check_int64_indices_without_truncating_them(kernels):
    """2^32 is chunk 0 if cut to 32 bits: the int64 kernels must see the whole value."""
    acc = tf.zeros([1001])
    for index in (2 ** 32, 2 ** 32 + 3, -2 ** 32, 2 ** 63 - 1):
        message = rf"indices\[0\] = {index} is out of range \[0, 11\)"
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"gather_chunks: {message}"):
            kernels.gather_chunks(acc, tf.constant([index], tf.int64), 100, F16, 1.0, None)
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"scatter_chunks: {message}"):
            kernels.scatter_chunks(tf.zeros([100], F16), tf.constant([index], tf.int64), 100,
                                   [[1001]], [F32], 1.0)


def test_chunk_kernels_on_an_empty_buffer_reject_every_index_and_accept_none(kernels):
    empty = tf.zeros([0])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"gather_chunks: indices\[0\] = 0 is out of range \[0, 0\)"):
        kernels.gather_chunks(empty, tf.constant([0]), 8, F16, 1.0, empty)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"scatter_chunks: indices\[0\] = 0 is out of range \[0, 0\)"):
        kernels.scatter_chunks(tf.zeros([0], F16), tf.constant([0]), 8, [[0], [0, 3]], [F32, F64], 1.0)
    none = tf.zeros([0], tf.int64)
    selected, residual, velocity = kernels.gather_chunks(empty, none, 8, BF16, tf.zeros([0]), empty)
    assert selected.dtype == BF16 and selected.shape == (0,)
    assert residual.shape == (0,) and velocity.shape == (0,)
    outputs = kernels.scatter_chunks(selected, none, 8, [[0], [0, 3]], [F32, F64], tf.zeros([0]))
    assert [o.shape for o in outputs] == [(0,), (0, 3)]
    acc, norms, _ = kernels.accumulate(empty, [tf.zeros([0, 2], F16)], 8, None, 0.0)
    assert acc.shape == (0,) and norms.shape == (0,)


@pytest.mark.parametrize("indices", [[], [4], [0, 10]], ids=["none", "one", "with_partial_last"])
def test_scatter_kernel_rejects_selected_of_the_wrong_run_time_length(kernels, indices):
    """1001 elements in chunks of 100: chunk 10 holds 1 element."""
    covered = sum(min(100, 1001 - 100 * c) for c in indices)
    scatter = _run_time(lambda sel, idx: kernels.scatter_chunks(sel, idx, 100, [[1001]], [F32], 1.0),
                        F16, tf.int32)
    for wrong in sorted({0, covered - 1, covered + 1, covered + 100} - {covered, -1}):
        message = (rf"scatter_chunks: selected has {wrong} elements but the chunks in indices "
                   rf"cover {covered}; they must match")
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            scatter(tf.zeros([wrong], F16), tf.constant(indices, tf.int32))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_chunk_kernels_reject_per_chunk_scales_of_the_wrong_run_time_length(kernels, k):
    indices = tf.constant([0, 2, 4][:k], tf.int32)
    gather = _run_time(lambda s, idx: kernels.gather_chunks(tf.zeros([50]), idx, 10, F16, s, None)[0],
                       F32, tf.int32)
    scatter = _run_time(lambda s, idx: kernels.scatter_chunks(tf.zeros([10 * k], F16), idx, 10,
                                                              [[50]], [F32], s), F32, tf.int32)
    for op, fn in (("GfGatherChunks", gather), ("GfScatterChunks", scatter)):
        for wrong in {0, k - 1, k + 1} - {k, -1}:
            message = (rf"{op}: scale must have shape \[\] or \[{k}\] \(one scale per selected "
                       rf"chunk, k = len\(indices\)\), got \[{wrong}\]")
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                fn(tf.ones([wrong]), indices)


def test_chunk_kernels_reject_a_velocity_or_residual_of_the_wrong_length(kernels):
    tensors = [tf.zeros([600]), tf.zeros([401], F16)]          # 1001 elements
    for wrong in (0, 1000, 1002):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"accumulate: the tensors hold 1001 elements in total but "
                                 rf"residual has {wrong}; they must match"):
            kernels.accumulate(tf.zeros([wrong]), tensors, 100, None, 0.0)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"accumulate: velocity has shape \[{wrong}\] but residual has \[1001\]"):
            kernels.accumulate(tf.zeros([1001]), tensors, 100, tf.zeros([wrong]), 0.9)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"gather_chunks: velocity has shape \[{wrong}\] but acc has \[1001\]"):
            kernels.gather_chunks(tf.zeros([1001]), tf.constant([10]), 100, F16, 1.0, tf.zeros([wrong]))


def test_unpack_kernel_rejects_a_packed_buffer_of_the_wrong_run_time_length(kernels):
    unpack = _run_time(lambda b: kernels.unpack(b, [[2, 3], [0], [1]], [F32, F16, F64], 1.0), BF16)
    for wrong in (0, 6, 8, 700):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"GfUnpack: the packed buffer has {wrong} elements but the "
                                 rf"shapes hold 7; they must match"):
            unpack(tf.zeros([wrong], BF16))


@pytest.mark.parametrize("chunk_size", [2 ** 31, 2 ** 62, 2 ** 63 - 1], ids=["2^31", "2^62", "2^63-1"])
def test_chunk_kernels_with_a_chunk_larger_than_the_buffer_see_one_chunk(kernels, chunk_size):
    """ceil(n / chunk_size) must not overflow: n + chunk_size - 1 would wrap for chunk_size near
    2^63, giving 0 chunks, norms [] and an accumulator never written."""
    sizes = [7, 0, 5]
    tensors, grad = random_tensors(sizes, (F32, F64, F16), spread=1.0)
    n = sum(sizes)
    residual = round_to(RNG.normal(size=n), F32)
    acc, norms, _ = kernels.accumulate(tf.constant(residual, F32), tensors, chunk_size, None, 0.0)
    expected_acc = round_to(residual + round_to(grad, F32), F32)
    assert_same(acc, expected_acc)
    assert norms.shape == (1,)
    np.testing.assert_allclose(as_f64(norms), [np.abs(expected_acc).sum()], rtol=2e-6)

    traced = tf.function(lambda r: kernels.accumulate(r, tensors, chunk_size, None, 0.0)[1])
    assert traced.get_concrete_function(tf.TensorSpec([n], F32)).output_shapes == [1]

    selected, new_residual, _ = kernels.gather_chunks(acc, tf.constant([0], tf.int64),
                                                      chunk_size, F32, 1.0, None)
    assert_same(selected, expected_acc)
    assert_same(new_residual, np.zeros(n))
    (out,) = kernels.scatter_chunks(selected, tf.constant([0]), chunk_size, [[n]], [F64], 1.0)
    assert_same(out, expected_acc)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"gather_chunks: indices\[0\] = 1 is out of range \[0, 1\)"):
        kernels.gather_chunks(acc, tf.constant([1]), chunk_size, F16, 1.0, None)


def test_under_asan_the_kernels_outputs_end_at_a_redzone(kernels):
    """nox -s asan is only a check if TensorFlow hands each output its own heap block: then
    the byte after a kernel's output is poisoned, and an overrun of one element is reported.
    A pooling allocator would make the ASan run vacuous; this notices. Skipped without ASan."""
    import ctypes  # pylint: disable=import-outside-toplevel
    try:
        is_poisoned = ctypes.CDLL(None).__asan_address_is_poisoned
    except AttributeError:
        pytest.skip("not running under AddressSanitizer (nox -s asan)")
    is_poisoned.argtypes, is_poisoned.restype = [ctypes.c_void_p], ctypes.c_int
    capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_pointer.argtypes, capsule_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
    acc = tf.constant(RNG.normal(size=100001), F32)
    selected, residual, _ = kernels.gather_chunks(acc, tf.constant([3, 1000]), 100, F16, 1.0, None)
    outputs = [selected, residual, kernels.pack([acc], F16, 1.0)]
    outputs += kernels.scatter_chunks(selected, tf.constant([3, 1000]), 100, [[100000], [1]], [F32, F16], 1.0)
    for t in outputs:
        capsule = tf.experimental.dlpack.to_dlpack(t)
        data = ctypes.c_void_p.from_address(capsule_pointer(capsule, b"dltensor")).value
        end = data + t.shape.num_elements() * t.dtype.size
        assert not is_poisoned(end - 1) and is_poisoned(end), (t.dtype, t.shape)
