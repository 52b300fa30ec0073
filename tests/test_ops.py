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
                                              vars(ops.compiled).items() if callable(v)}),
    "composite": ops.composite,
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(request):
    if request.param.startswith("compiled") and ops._lib() is None:
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
    if ops._lib() is None:
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
    if ops._lib() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    assert ops.library_status().startswith("compiled (")
    x = tf.constant(RNG.normal(size=100), F32)
    fn = tf.function(lambda x: ops.unpack(ops.pack([x], F16, 0.5), [[100]], [F32], 2.0))
    assert {"GfPack", "GfUnpack"} <= _graph_op_types(fn, x)


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
    monkeypatch.setattr(ops, "_library", ops._Library())
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
