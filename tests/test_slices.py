"""Sparse gradients (tf.IndexedSlices) on a 16-bit wire: gf_tf.slices against NumPy float64.

The encoding alone on fresh random rows and nasty ones; then through GradientFlowAllReduce under
MirroredStrategy over 2 logical CPUs (ReductionToOneDevice: TensorFlow's gather of IndexedSlices,
as tests/test_cross_device_ops.py), where a float32 wire leaves them untouched.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import slices
from helpers import fp16_pack_bytes
from test_cross_device_ops import MEAN, SUM, batch_reduce, make

NASTY_ROWS = [np.zeros(6), [65504.0, -1.0, 0.5, 0, 3, 1e-3], [1e6, -2e6, 1.0, 7.0, 0.0, 1e-9],
              [3e38, -1e30, 1.0, 0, 0, 0], [1e-7, -3e-8, 6e-8, 1e-12, 0, 2e-7],
              [1e-40, 0, 0, 0, 0, 0], [np.nan, 1.0, 2.0, 0, 0, 0], [np.inf, -1.0, 0, 0, 0, 0],
              [-np.inf, 1e5, 0, 0, 0, 0], [1.0] * 6]


def _rows(rng, n, d):
    """n random rows of d elements, each at its own magnitude (1e-30 to 1e30)."""
    return rng.normal(size=(n, d)) * 10.0 ** rng.uniform(-30, 30, size=(n, 1))


def _check_round_trip(values, dtype):
    """decode(encode(x)) against x in float64, row by row: within 2**-11 of each element plus
    2**-38 of the row's largest (float16 subnormals after scaling); non-finite elements stay."""
    x = tf.constant(values, dtype)
    original = x.numpy().astype(np.float64)
    like = tf.IndexedSlices(x, tf.range(tf.shape(x)[0]), tf.constant([10**6, 6]))
    encoded = slices.encode(like)
    assert encoded.values.dtype == tf.float16 and encoded.values.shape[1] == x.shape[1] + 1
    assert encoded.dense_shape.numpy().tolist() == [10**6, 7]   # TF's gather checks rows by it
    out = slices.decode(encoded, like)
    assert out.values.dtype == dtype
    got = out.values.numpy().astype(np.float64)
    assert got.shape == original.shape
    width = int(np.prod(original.shape[1:]))
    for row, back in zip(original.reshape(-1, width), got.reshape(-1, width)):
        finite = np.isfinite(row)
        if not finite.all():   # travels unscaled: NaN and inf stay where they were
            np.testing.assert_array_equal(np.isnan(back), np.isnan(row))
            np.testing.assert_array_equal(back[np.isinf(row)], row[np.isinf(row)])
            continue
        largest = np.abs(row).max(initial=0.0)
        if largest < 2.0 ** -126:   # below float32's normal range: flushed, never enlarged
            assert np.all(np.abs(back) <= largest)
            continue
        bound = 2.0 ** -11 * np.abs(row) + 2.0 ** -38 * largest
        assert np.all(np.abs(back - row) <= bound), (row, back)


@pytest.mark.parametrize("n", [0, 1, 7, 1009])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_at_any_magnitude_keep_eleven_bits(n, seed):
    _check_round_trip(_rows(np.random.default_rng(seed), n, 6), tf.float32)


def test_nasty_rows():
    """Zeros, 65504, float16 overflow (1e6, 3e38), float16 subnormals (1e-7), a float32
    subnormal (1e-40), NaN and +-inf."""
    _check_round_trip(np.array(NASTY_ROWS), tf.float32)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_16_bit_rows_come_back_bit_for_bit(dtype):
    """A float16 or bfloat16 row within 2**10 of its largest element is exact in scaled
    float16: the round trip gives it back unchanged, in its own dtype."""
    rng = np.random.default_rng(2)
    values = tf.constant(rng.uniform(1.0, 1000.0, size=(9, 5)) * rng.choice([-1, 1], (9, 5))
                         * 10.0 ** rng.integers(-3, 2, size=(9, 1)), dtype)
    like = tf.IndexedSlices(values, tf.range(9), tf.constant([20, 5]))
    out = slices.decode(slices.encode(like), like)
    np.testing.assert_array_equal(out.values.numpy(), values.numpy())


def test_rows_of_higher_rank_keep_their_shape():
    values = _rows(np.random.default_rng(3), 4, 12).reshape(4, 3, 4)
    like = tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant([0, 2, 2, 5]),
                            tf.constant([6, 3, 4]))
    encoded = slices.encode(like)
    assert encoded.values.shape == (4, 13)
    out = slices.decode(encoded, like)
    assert out.values.shape == (4, 3, 4)
    np.testing.assert_allclose(out.values.numpy(), values.astype(np.float32), rtol=2.0 ** -11)


def test_a_dense_sum_of_encoded_rows_is_refused():
    like = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([4, 3]))
    with pytest.raises(ValueError, match="compression=None"):
        slices.decode(tf.ones([4, 4], tf.float16), like)


def test_encodable_only_float_rows_of_known_length():
    assert slices.encodable(tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1])))
    assert not slices.encodable(tf.IndexedSlices(tf.ones([2, 3], tf.float64), tf.constant([0, 1])))
    assert not slices.encodable(tf.IndexedSlices(tf.ones([2, 3], tf.int32), tf.constant([0, 1])))
    assert not slices.encodable(tf.ones([2, 3]))


# --- through GradientFlowAllReduce --------------------------------------------------------

def _replica_slices(rng, rows_per_replica, dense_shape, dtype=np.float32):
    return [tf.IndexedSlices(tf.constant(_rows(rng, n, dense_shape[1]).astype(dtype)),
                             tf.constant(rng.integers(0, dense_shape[0], n), tf.int64),
                             tf.constant(dense_shape, tf.int64))
            for n in rows_per_replica]


def _dense(value):
    return tf.math.unsorted_segment_sum(tf.cast(value.values, tf.float64), value.indices,
                                        value.dense_shape[0]).numpy()


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("reduce_op", [SUM, MEAN])
def test_a_16_bit_wire_gathers_each_row_within_eleven_bits(compression, reduce_op):
    """2 replicas, 5 and 3 rows of an [11, 4] table beside a dense gradient: the reduced
    IndexedSlices equal the float64 sum (MEAN: / 2) of both replicas' rows within 2**-11 per
    element; CommStats counts 2 (4 + 1) + 8 bytes per row of replica 0 beside the pack."""
    rng = np.random.default_rng(7)
    sparse = _replica_slices(rng, [5, 3], [11, 4])
    dense = [rng.normal(size=13).astype(np.float32) for _ in range(2)]
    gfar, strategy = make(2, compression=compression)
    out = batch_reduce(gfar, strategy, [[sparse[0], dense[0]], [sparse[1], dense[1]]], reduce_op)
    divide = 2.0 if reduce_op == MEAN else 1.0
    rows = np.concatenate([s.values.numpy().astype(np.float64) for s in sparse]) / divide
    for value in out[0]:
        assert isinstance(value, tf.IndexedSlices) and value.values.dtype == tf.float32
        np.testing.assert_array_equal(value.indices.numpy(),
                                      np.concatenate([s.indices.numpy() for s in sparse]))
        bound = 2.0 ** -11 * np.abs(rows) + 2.0 ** -38 * np.abs(rows).max(1, keepdims=True)
        assert np.all(np.abs(value.values.numpy() - rows) <= bound)
    dense_bytes = 4 * 13 + 5 * (4 * 4 + 8)
    stats = gfar.stats.result()
    assert stats["dense_bytes_per_step"] == dense_bytes
    # FP16: the pack's slots (its bound a step ahead) and the first step's float32 retry
    pack_bytes = fp16_pack_bytes(13, 1, 0.5) if compression == "fp16" else 2 * 13
    assert stats["sent_bytes_per_step"] == pack_bytes + 5 * (2 * (4 + 1) + 8)


def test_a_float32_wire_leaves_them_bit_for_bit_as_tensorflows_gather():
    rng = np.random.default_rng(8)
    sparse = _replica_slices(rng, [4, 6], [9, 3])
    gfar, strategy = make(2, compression=None)
    out = batch_reduce(gfar, strategy, [[sparse[0]], [sparse[1]]])
    expected = _dense(sparse[0]) + _dense(sparse[1])
    for value in out[0]:
        assert value.values.dtype == tf.float32
        np.testing.assert_array_equal(value.values.numpy(),
                                      np.concatenate([s.values.numpy() for s in sparse]))
        np.testing.assert_allclose(_dense(value), expected, rtol=1e-6)
    assert gfar.stats.result()["sent_bytes_per_step"] == 4 * (4 * 3 + 8)


def test_float64_and_integer_slices_pass_through_exactly_on_a_16_bit_wire():
    rng = np.random.default_rng(9)
    f64 = _replica_slices(rng, [2, 3], [5, 2], np.float64)
    ints = [tf.IndexedSlices(tf.constant([[1, 2]] * n, tf.int32), tf.constant(list(range(n))),
                             tf.constant([5, 2])) for n in (1, 2)]
    gfar, strategy = make(2, compression="fp16")
    out = batch_reduce(gfar, strategy, [[f64[0], ints[0]], [f64[1], ints[1]]])
    for value in out[0]:
        assert value.values.dtype == tf.float64
        np.testing.assert_array_equal(value.values.numpy(),
                                      np.concatenate([s.values.numpy() for s in f64]))
    for value in out[1]:
        np.testing.assert_array_equal(value.values.numpy(), [[1, 2]] * 3)


@pytest.mark.parametrize("compression, method, workers, expected", [
    ("fp16", "fp16", 1, True), ("bf16", "bf16", 2, True), (None, "none", 2, False),
    ("auto", "tf", 2, True),      # the planner's TF own for the dense set: rows still 16-bit
    ("auto", "fp16", 2, True), ("auto", "none", 2, True),
    ("auto", "tf", 1, False),     # one worker: nothing crosses a link
    ("auto", "none", 1, False),
])
def test_which_sets_send_their_slices_16_bit(compression, method, workers, expected):
    from gf_tf import plan, route

    settings = plan.Settings(compression=compression)
    set_plan = plan.Plan(method=method, bytes_per_pack=0, algorithm="ring")
    assert route.slices_on_16bit_wire(settings, set_plan, workers) is bool(expected)


def test_the_handshake_compares_whether_slices_travel_16_bit():
    """Two workers whose dense plans agree ("none" packs) but whose rows would not (one under
    "auto", one with compression=None) differ in the handshake's row for it, not elsewhere: a
    gather of float16 [rows, d + 1] against float32 [rows, d] never starts."""
    from gf_tf import route
    from gf_tf.plan import Forecast, Plan, Planned
    from gf_tf.reducers import DenseReducer
    planned = Planned(Plan("none", 0, "ring"), Forecast())
    rows = [route.settings((), planned, DenseReducer(), slices_16bit=flag) for flag in (True, False)]
    differ = [(a[0], a[2](a[1]), b[2](b[1])) for a, b in zip(*rows) if a[1] != b[1]]
    assert differ == [("IndexedSlices on the 16-bit wire", "True", "False")]


# --- real workers -------------------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_gather_16_bit_rows_of_different_lengths_and_fit_an_embedding():
    """2 worker processes (tests/workers/slices_worker.py): worker 0's 5 rows and worker 1's 3
    (TensorFlow's gather pads them) come back on both as the float64 MEAN within 2**-11 per
    element under compression="auto" (16-bit rows whatever the planner picks for the dense
    gradient), and bit for bit as float32 with compression=None; an Embedding model fitted 3
    steps ends with the same weights on both workers, within 1e-3 of the float32 wire's."""
    import cluster

    runs = {}
    for compression in ("auto", "none"):
        results = cluster.run_workers("slices_worker.py", 2, [f"--compression={compression}"],
                                      timeout=150, comm_timeout=30)
        assert all(r.ok for r in results), cluster.describe(results)
        runs[compression] = [r.result for r in results]
    workers = [tuple(runs["auto"][rank][f"own_{k}"] for k in ("values", "indices", "dense"))
               for rank in range(2)]
    rows = np.concatenate([v.astype(np.float64) for v, _, _ in workers]) / 2.0
    for compression, results in runs.items():
        for result in results:
            np.testing.assert_array_equal(result["indices"],
                                          np.concatenate([i for _, i, _ in workers]))
            np.testing.assert_allclose(result["dense"], (workers[0][2] + workers[1][2]) / 2.0,
                                       rtol=2e-3 if compression == "auto" else 1e-6)
            if compression == "none":
                np.testing.assert_array_equal(result["values"],
                                              np.concatenate([v for v, _, _ in workers]) / 2.0)
            else:
                bound = 2.0 ** -11 * np.abs(rows) + 2.0 ** -38 * np.abs(rows).max(1, keepdims=True)
                assert np.all(np.abs(result["values"] - rows) <= bound)
        for key in (k for k in results[0] if k.startswith("w")):
            np.testing.assert_array_equal(results[0][key], results[1][key])
    for key in (k for k in runs["none"][0] if k.startswith("w")):
        np.testing.assert_allclose(runs["auto"][0][key], runs["none"][0][key], rtol=1e-3, atol=1e-4)
    # This worker's 5 rows: 2 (4 + 1) + 8 bytes each as 16-bit rows, 4 x 4 + 8 as float32,
    # beside the dense gradient (13 elements): TensorFlow's own float32, or an FP16 pack scaled
    # a step ahead (its slots after the values), whose first step has no bound and goes again
    # in float32 with its bound, whichever the planner picked.
    assert float(runs["auto"][0]["all_reduce_sent_bytes"]) in (
        5 * 18 + 4 * 13, 5 * 18 + fp16_pack_bytes(13, 1, retries=1))
    assert float(runs["none"][0]["all_reduce_sent_bytes"]) == 5 * 24 + 4 * 13
