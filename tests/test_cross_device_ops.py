"""gf_tf.GradientFlowAllReduce against NumPy float64, and under MirroredStrategy + Keras fit.

In-process tests run on the logical CPUs of tests/conftest.py with TF's
ReductionToOneDevice as the wrapped ops: TF 2.21 numbers the collective groups
and instances of every MirroredStrategy object from the same keys, so one
process cannot host several strategies with collectives. The tests that use
MirroredStrategy's own CollectiveAllReduce (model.fit on 2 and 3 devices, the
replica-context path) therefore each run in a fresh process
(tests/workers/mirrored_worker.py).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import cluster
import gf_tf
from gf_tf import tf_internal
from gf_tf.plan import DEFAULT_BYTES_PER_PACK
from helpers import fp16_pack_bytes

DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN
RNG = np.random.default_rng(1234)


def make(num_replicas, **kwargs):
    """A MirroredStrategy over GradientFlow's FP16 packs (its default before the planner: one
    worker's "auto" is TF's own all-reduce, tested in test_planner.py)."""
    assert len(DEVICES) >= num_replicas, f"need {num_replicas} logical CPUs, have {DEVICES}"
    kwargs.setdefault("compression", "fp16")
    kwargs.setdefault("bytes_per_pack", DEFAULT_BYTES_PER_PACK)
    gfar = gf_tf.GradientFlowAllReduce(cross_device_ops=tf.distribute.ReductionToOneDevice(),
                                       **kwargs)
    return gfar, tf.distribute.MirroredStrategy(DEVICES[:num_replicas], cross_device_ops=gfar)


def batch_reduce(gfar, strategy, per_replica, reduce_op=SUM, steps=2):
    """per_replica[r] = list of gradients of replica r, all-reduced as gradients
    (gf_tf.all_reduce_gradients in strategy.run) `steps` times for the same variables -> per
    value, list of per-replica results of the last step. Two by default: the dense reducer sends
    a set's first step in float32 (no bound a step ahead yet, gf_tf.reducers.dense), the second
    on the FP16 wire."""
    num_values = len(per_replica[0])
    variables = [tf.Variable(0.0, name=f"v{k}") for k in range(num_values)]

    def value(k):
        def fn(ctx):
            v = per_replica[ctx.replica_id_in_sync_group][k]
            if v is None or isinstance(v, tf.IndexedSlices):
                return v
            return tf.identity(tf.constant(v))
        return None if per_replica[0][k] is None else \
            strategy.experimental_distribute_values_from_function(fn)

    values = [value(k) for k in range(num_values)]

    def step(*args):
        args = [a if a is None or isinstance(a, tf.IndexedSlices) else tf.identity(a) for a in args]
        return gf_tf.all_reduce_gradients(list(args), variables, reduce_op)

    for _ in range(steps):
        out = strategy.run(step, args=tuple(values))
    return [None if o is None else list(strategy.experimental_local_results(o)) for o in out]


def numpy_sum(per_replica, k):
    return np.sum([np.asarray(r[k], np.float64) for r in per_replica], axis=0)


def test_fp16_sum_of_four_replicas_of_2e4_is_finite():
    gfar, strategy = make(4)
    out = batch_reduce(gfar, strategy, [[np.full([3], 2e4, np.float32)]] * 4)
    for v in out[0]:
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v.numpy(), np.full([3], 8e4, np.float32))


def test_fp16_sums_beyond_65504_stay_finite_and_exact_when_float32_is():
    """The power-of-two scale comes from the all-reduced bound, not from 1/N: a SUM of
    4 x 7e4 (beyond FP16's 65504 even as a mean) travels scaled and comes back finite."""
    gfar, strategy = make(4)
    values = np.array([7e4, -7e4, 65504.0, 1.0], np.float32)
    out = batch_reduce(gfar, strategy, [[values]] * 4)
    got = out[0][0].numpy()
    np.testing.assert_allclose(got, 4.0 * values, rtol=2 ** -11)
    assert np.all(np.isfinite(got))


def test_a_pack_holding_1e3_beside_1e_minus_8_keeps_both_to_fp16_precision():
    """The issue's example: one pack (both tensors fit in 4 MiB) holds four values of 1e3 and
    the values 1e-8 .. 1e-5, on 2 replicas. With a scale per tensor every SUM comes back within
    FP16's relative precision 2^-11 (a fixed 1/N prescale gave [0, 0, +19%, ...])."""
    gfar, strategy = make(2)
    big = np.full(4, 1e3, np.float32)
    small = np.array([1e-8, 3e-8, 1e-7, 1e-6, 1e-5], np.float32)
    out = batch_reduce(gfar, strategy, [[big, small], [big, small]])
    (variable_set,) = gfar.states().values()
    assert len(variable_set.pack_specs) == 1                      # one pack
    for k, values in enumerate((big, small)):
        for v in out[k]:
            np.testing.assert_allclose(v.numpy(), 2.0 * values.astype(np.float64), rtol=2 ** -11)


def test_inf_and_nan_gradients_stay_non_finite():
    gfar, strategy = make(2)
    a = np.array([np.inf, 1.0, 2.0], np.float32)
    b = np.array([1.0, np.nan, 2.0], np.float32)
    got = batch_reduce(gfar, strategy, [[a, b], [a, b]])
    assert got[0][0].numpy()[0] == np.inf and np.isnan(got[1][0].numpy()[1])


def test_bf16_keeps_the_float32_range():
    gfar, strategy = make(4, compression="bf16")
    out = batch_reduce(gfar, strategy, [[np.array([7e4, 1e30, 3.0], np.float32)]] * 4)
    np.testing.assert_allclose(out[0][0].numpy(), [2.8e5, 4e30, 12.0], rtol=2 ** -8)


def test_mixed_dtype_list_matches_numpy_in_callers_order():
    gfar, strategy = make(3, bytes_per_pack=256)
    shapes = [(1009,), (7,), (13,), (5,), (1,), (4, 3)]
    dtypes = [np.float32, np.float16, np.float64, np.int32, np.float32, np.float32]
    per_replica = []
    for _ in range(3):
        row = []
        for shape, dtype in zip(shapes, dtypes):
            if dtype == np.int32:
                row.append(RNG.integers(-1000, 1000, shape).astype(dtype))
            else:
                row.append(RNG.normal(size=shape).astype(dtype))
        per_replica.append(row)
    out = batch_reduce(gfar, strategy, per_replica)
    for k, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        want = numpy_sum(per_replica, k)
        for v in out[k]:
            got = v.numpy()
            assert got.dtype == dtype and got.shape == shape, (k, got.dtype, got.shape)
            if dtype == np.int32:
                np.testing.assert_array_equal(got, want)
            elif dtype == np.float64:      # not compressed: exact up to summation order
                np.testing.assert_allclose(got, want, rtol=1e-12)
            else:                          # FP16 wire: ~2^-11 relative per term and in the sum
                np.testing.assert_allclose(got, want, rtol=0, atol=3 * 2 ** -10 * np.max(np.abs(want)) + 1e-3)
    # Only float32 and float16 values were packed: 1009 + 7 + 1 + 12 elements, in FP16 on the
    # wire. The float16 pack adds one float32 scale bound per tensor in a control all-reduce;
    # each float32 pack (scaled a step ahead) its FP16 slots, and at the first of the two
    # steps its float32 retry: 4 bytes per element and per tensor (gf_tf.reducers.dense).
    stats = gfar.stats.result()
    assert stats["dense_bytes_per_step"] == 4 * (1009 + 7 + 1 + 12)
    (state,) = gfar.states().values()
    packs = [(spec.num_elements, len(spec.shapes), spec.dtypes[0]) for spec in state.pack_specs
             if spec.num_elements]
    assert stats["sent_bytes_per_step"] == sum(
        2 * n + 4 * t if dtype == tf.float16 else fp16_pack_bytes(n, t, retries=0.5)
        for n, t, dtype in packs)
    assert gfar.stats.totals()["figure_float32_retries"] == sum(
        1 for _, _, dtype in packs if dtype == tf.float32)


def test_indexed_slices_pass_through_untouched_on_a_float32_wire():
    """(On a 16-bit wire they travel as scaled float16 rows: tests/test_slices.py.)"""
    gfar, strategy = make(2, compression=None)
    slices = [tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([5, 2])),
              tf.IndexedSlices(tf.constant([[3.0, 4.0], [5.0, 6.0]]), tf.constant([1, 3]),
                               tf.constant([5, 2]))]
    dense = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = batch_reduce(gfar, strategy, [[slices[0], dense], [slices[1], 2 * dense]])
    for v in out[0]:
        assert isinstance(v, tf.IndexedSlices)
        np.testing.assert_array_equal(tf.convert_to_tensor(v).numpy(),
                                      [[0, 0], [4, 6], [0, 0], [5, 6], [0, 0]])
    for v in out[1]:
        np.testing.assert_array_equal(v.numpy(), 3 * dense)


def test_zero_size_values_keep_their_shapes():
    gfar, strategy = make(2)
    per_replica = [[np.zeros([0], np.float32), np.zeros([3, 0], np.float32),
                    np.full([5], r + 1.0, np.float32)] for r in range(2)]
    out = batch_reduce(gfar, strategy, per_replica)
    assert [v.shape for v in out[0]] == [(0,)] * 2
    assert [v.shape for v in out[1]] == [(3, 0)] * 2
    for v in out[2]:
        np.testing.assert_array_equal(v.numpy(), np.full([5], 3.0))

    # A pack holding only empty tensors issues no collective and still returns them.
    out = batch_reduce(gfar, strategy, [[np.zeros([0, 4], np.float32)]] * 2)
    assert [v.shape for v in out[0]] == [(0, 4)] * 2


def test_none_values_come_back_in_place():
    gfar, strategy = make(2)
    out = batch_reduce(gfar, strategy, [[None, np.ones([2], np.float32), None]] * 2)
    assert out[0] is None and out[2] is None
    np.testing.assert_array_equal(out[1][0].numpy(), [2.0, 2.0])


def test_mean_and_nan():
    gfar, strategy = make(2)
    a = np.array([1.0, np.nan, 3.0, 1e-6], np.float32)
    b = np.array([3.0, 1.0, np.inf, 1e-6], np.float32)
    got = batch_reduce(gfar, strategy, [[a], [b]], reduce_op=MEAN)[0][0].numpy()
    assert got[0] == 2.0 and np.isnan(got[1]) and got[2] == np.inf
    # A tensor holding inf or NaN has no finite bound: its pack goes again in float32, where
    # 1e-6 comes back exact (an unscaled FP16 would round it to a multiple of 2^-24) ...
    assert got[3] == np.float32(1e-6)
    assert gfar.stats.totals()["figure_float32_retries"] == 2
    # ... while in a finite tensor it is scaled into FP16's normal range and keeps 11 bits.
    got = batch_reduce(gfar, strategy, [[a[3:]], [b[3:]]], reduce_op=MEAN)[0][0].numpy()
    np.testing.assert_allclose(got, [1e-6], rtol=2 ** -11)


def test_many_tiny_tensors_travel_in_the_planned_packs():
    """100 float32 tensors of 10 elements, bytes_per_pack=1024: two FP16 packs (510 and 490
    elements, 1020 and 980 bytes, each with its slots), seen as float16 reductions in the
    traced graph; the second step's sums within FP16 rounding."""
    gfar, strategy = make(2, bytes_per_pack=1024)
    grads = [[RNG.normal(size=[10]).astype(np.float32) for _ in range(100)] for _ in range(2)]
    variables = [tf.Variable(0.0) for _ in range(100)]

    @tf.function
    def step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            values = [tf.identity(tf.gather(tf.constant(np.stack([g[k] for g in grads])), r))
                      for k in range(100)]
            return gf_tf.all_reduce_gradients(values, variables)
        return strategy.run(replica_fn)

    step()   # the first step: float32 retries (no bounds yet)
    out = step()
    half_sums = sorted(op.outputs[0].shape.num_elements()
                       for op in step.get_concrete_function().graph.get_operations()
                       if op.type == "AddN" and op.get_attr("T") == tf.float16)
    assert half_sums == [490 + gf_tf.wire.ahead_slots(49), 510 + gf_tf.wire.ahead_slots(51)]
    stats = gfar.stats.result()
    assert stats["float32_retries_per_step"] == 1   # both packs at the first of the two steps
    assert stats["sent_bytes_per_step"] == fp16_pack_bytes(490, 49, 0.5) + fp16_pack_bytes(510, 51, 0.5)
    assert stats["dense_bytes_per_step"] == 4000
    for k in range(100):
        want = grads[0][k].astype(np.float64) + grads[1][k]
        for v in strategy.experimental_local_results(out[k]):
            np.testing.assert_allclose(v.numpy(), want, atol=4e-3)


def test_reduce_locally_runs_the_fp16_route_with_identity_collectives():
    """One replica, every collective the identity: the first step comes back exact (its float32
    retry), the second as its FP16 wire leaves it, scaled by the power of two of the first
    step's max |g| a step ahead and unscaled (float64 reference)."""
    gfar, strategy = make(1)
    grads = [RNG.normal(size=s).astype(np.float32) * 1e-4 for s in ((7, 3), (1009,))]
    variables = [tf.Variable(tf.zeros(g.shape)) for g in grads]
    step = tf.function(lambda: gfar.reduce_locally(strategy, [tf.constant(g) for g in grads],
                                                   variables))
    for got, g in zip(step(), grads):
        np.testing.assert_array_equal(got.numpy(), g)
    for got, g in zip(step(), grads):
        scale = (gf_tf.wire.power_of_two_scale_np(np.abs(g).max())
                 / 2 ** gf_tf.wire.AHEAD_HEADROOM_BITS)
        want = np.float16(g.astype(np.float64) * scale).astype(np.float64) / scale
        np.testing.assert_array_equal(got.numpy().astype(np.float64), want)
    assert gfar.stats.result()["sent_bytes_per_step"] == fp16_pack_bytes(1030, 2, 0.5)


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="compression must be"):
        gf_tf.GradientFlowAllReduce(compression="int8")
    with pytest.raises(ValueError, match="bytes_per_pack"):
        gf_tf.GradientFlowAllReduce(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="not another GradientFlowAllReduce"):
        gf_tf.GradientFlowAllReduce(cross_device_ops=gf_tf.GradientFlowAllReduce())
    with pytest.raises(ValueError, match="pass cross_device_ops|Pass cross_device_ops"):
        tf_internal.default_cross_device_ops(tf.distribute.OneDeviceStrategy("/cpu:0"))
    with pytest.raises(TypeError, match="gradient_flow must be"):
        gf_tf.MultiWorkerMirroredStrategy(gradient_flow="fp16")


# --- MirroredStrategy's own collectives, one fresh process per run ----------------------

MODEL_ELEMENTS = 8 * 32 + 32 + 32 * 3 + 3   # mirrored_worker's Dense(32) -> Dense(3)


def run_mirrored(*args):
    r = cluster.run_process("mirrored_worker.py", list(args), timeout=150)
    assert r.ok, cluster.describe([r])
    return r.result


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 3])
def test_mirrored_strategy_fit_runs_the_fp16_path(devices):
    gf = run_mirrored("--devices", str(devices))
    # Our path ran: the traced step's collectives are, once per replica, one float16 pack of all
    # 387 gradient elements with its slots (wire.ahead_slots), and its float32 retry (the elements and
    # the 4 tensors' bounds), taken at the first step (gf_tf.reducers.dense).
    # (The walker may find the step in more than one concrete function: counts are multiples.)
    pairs = sorted(zip(gf["reduce_dtypes"].tolist(), gf["reduce_elements"].tolist()))
    copies = pairs.count(("float16", MODEL_ELEMENTS + gf_tf.wire.ahead_slots(4))) // devices
    assert copies and pairs == [("float16", MODEL_ELEMENTS + gf_tf.wire.ahead_slots(4))] * copies * devices + \
        [("float32", MODEL_ELEMENTS + 4)] * copies * devices, pairs
    retries = float(gf["retries_per_step"])
    assert 0.25 <= retries < 1   # 4 steps: the first and at most two more
    assert float(gf["sent_bytes_per_step"]) == fp16_pack_bytes(MODEL_ELEMENTS, 4, retries)
    assert float(gf["dense_bytes_per_step"]) == 4 * MODEL_ELEMENTS
    # ... and the weights match TF's float32 all-reduce within FP16 tolerance.
    for k in range(4):
        np.testing.assert_allclose(gf[f"w{k}"], gf[f"plain_w{k}"], atol=2e-3, rtol=0)
        assert np.any(gf[f"w{k}"] != gf[f"plain_w{k}"])
    np.testing.assert_allclose(gf["loss"], gf["plain_loss"], rtol=1e-3)
    # The replica-context path (_all_reduce, used without merge_call) on the same strategy.
    np.testing.assert_allclose(gf["replica_a"], np.broadcast_to(gf["replica_a_ref"], gf["replica_a"].shape),
                               atol=2 ** -9 * np.max(np.abs(gf["replica_a_ref"])))
    np.testing.assert_array_equal(gf["replica_b"], np.broadcast_to(gf["replica_b_ref"], gf["replica_b"].shape))
    np.testing.assert_allclose(gf["replica_c"], np.broadcast_to(gf["replica_c_ref"], gf["replica_c"].shape),
                               rtol=1e-12)
    assert bool(gf["replica_none_is_none"])
    assert int(gf["replica_stat_steps"]) == 1     # the replica path counts its step once, too


@pytest.mark.slow
def test_replica_context_path_runs_csc_with_real_collectives():
    """Without merge_call (as under XLA on all-GPU devices) each replica runs the same funnel:
    CSC's first step sends the top chunk (of 2) of the 7-element float32 gradient."""
    gf = run_mirrored("--devices", "2", "--density", "0.5")
    a_sum = gf["replica_a_ref"]
    chunks = [slice(0, 4), slice(4, 7)]
    # The chunk norms are all-reduced: the SUM over replicas of each replica's chunk L1 norm.
    per_replica = gf["replica_a_inputs"]
    norms = [np.abs(per_replica[:, c]).sum() for c in chunks]
    want = np.zeros(7)
    want[chunks[int(np.argmax(norms))]] = a_sum[chunks[int(np.argmax(norms))]]
    for got in gf["replica_a"]:
        np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=1e-6)
    np.testing.assert_array_equal(gf["replica_b"], np.broadcast_to(gf["replica_b_ref"], gf["replica_b"].shape))
    assert int(gf["replica_stat_steps"]) == 1
    assert all(np.all(np.isfinite(gf[f"w{k}"])) for k in range(4))


@pytest.mark.slow
def test_mirrored_strategy_mixed_float16_with_loss_scale_optimizer():
    gf = run_mirrored("--devices", "2", "--mixed_precision")
    assert str(gf["optimizer"]) == "LossScaleOptimizer"
    assert ("float16", MODEL_ELEMENTS + gf_tf.wire.ahead_slots(4)) in list(zip(gf["reduce_dtypes"], gf["reduce_elements"]))
    assert all(np.all(np.isfinite(gf[f"w{k}"])) for k in range(4))
    assert np.all(np.isfinite(gf["loss"]))


def test_one_instance_serves_one_strategy():
    gfar = gf_tf.GradientFlowAllReduce()   # takes MirroredStrategy's own cross-device ops
    first = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    second = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    value = first.experimental_distribute_values_from_function(lambda ctx: tf.identity(1.0))
    with first.scope():   # traced, not run: takes the first strategy's ops, runs no collective
        tf.function(lambda: gfar.batch_reduce(SUM, [(value, value)])).get_concrete_function()
    with second.scope(), pytest.raises(ValueError, match="one GradientFlowAllReduce per strategy"):
        gfar.batch_reduce(SUM, [(value, value)])


def test_reduce_broadcast_and_gather_are_forwarded_exactly():
    """Single values (strategy.reduce: losses, metrics), broadcasts and gathers are not compressed."""
    gfar, strategy = make(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.identity(tf.constant([1e5, 1.0 + 2 ** -20], tf.float32) * tf.cast(
            ctx.replica_id_in_sync_group + 1, tf.float32)))
    with strategy.scope():
        reduced = gfar.reduce(SUM, value, destinations=value)
        for v in strategy.experimental_local_results(reduced):
            np.testing.assert_array_equal(v.numpy(), np.float32([3e5, 3 * (1.0 + 2 ** -20)]))
        gathered = strategy.gather(value, axis=0)
        np.testing.assert_array_equal(gathered.numpy(), np.float32([1e5, 1.0 + 2 ** -20,
                                                                    2e5, 2 * (1.0 + 2 ** -20)]))
        copies = gfar.broadcast(tf.constant([7e4, 2.5]), destinations=value)
        for v in strategy.experimental_local_results(copies):
            np.testing.assert_array_equal(v.numpy(), np.float32([7e4, 2.5]))
    assert gfar.stats.result()["steps"] == 0
