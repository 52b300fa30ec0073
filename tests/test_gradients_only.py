"""GradientFlow touches gradients and nothing else; its state belongs to the variables it serves.

Against NumPy float64 references (and, for pass-through, bit for bit against the
same strategy without GradientFlow), on the logical CPUs of tests/conftest.py.
The wrapped ops are TF's ReductionToOneDevice (see test_cross_device_ops.py for why).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from csc_reference import NumpyCSC
from helpers import fp16_pack_bytes

DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
SETTINGS = {
    "fp16": dict(compression="fp16"),
    "bf16": dict(compression="bf16"),
    "csc": dict(compression="fp16", sparsity=gf_tf.ChunkSparsity(density=0.5, chunk_size=4)),
}


def mirrored(num_replicas=2, **settings):
    """(GradientFlowAllReduce or None, MirroredStrategy over ReductionToOneDevice)."""
    ops = tf.distribute.ReductionToOneDevice()
    if settings:
        ops = gf_tf.GradientFlowAllReduce(cross_device_ops=ops, **settings)
    return (ops if settings else None), tf.distribute.MirroredStrategy(
        DEVICES[:num_replicas], cross_device_ops=ops)


# --- not gradients: passed through exactly -------------------------------------------

def _sync_bn_step(strategy, x, momentum=0.99):
    """One training-mode call of BatchNormalization(synchronized=True) on 2 replicas."""
    with strategy.scope():
        bn = keras.layers.BatchNormalization(synchronized=True, momentum=momentum)
        bn.build((None, x.shape[1]))
    half = len(x) // 2

    @tf.function
    def step():
        def fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            shard = tf.identity(tf.constant(x)[r * half:(r + 1) * half])
            return bn(shard, training=True)
        return strategy.run(fn)

    out = strategy.experimental_local_results(step())
    return np.concatenate([o.numpy() for o in out]), bn


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("channels,mean,std", [(8, 50.0, 1.0), (8, 0.0, 300.0),
                                               (300, 50.0, 1.0), (300, 1e3, 300.0)])
def test_sync_batch_norm_statistics_pass_through_exactly(setting, channels, mean, std):
    """SyncBN all-reduces per-channel sums, sums of squares and counts: under FP16, BF16 and
    CSC (chunks of 4 elements, half of them sent) they must be what stock TF computes, bit for
    bit, and match float64 to float32 rounding (more channels than one chunk; sums of squares
    far beyond FP16's 65504)."""
    x = np.random.default_rng(channels).normal(mean, std, size=(8, channels)).astype(np.float32)
    _, strategy = mirrored(**SETTINGS[setting])
    got, bn = _sync_bn_step(strategy, x)
    _, stock = mirrored()
    want_bits, stock_bn = _sync_bn_step(stock, x)
    np.testing.assert_array_equal(got, want_bits)
    np.testing.assert_array_equal(bn.moving_variance.numpy(), stock_bn.moving_variance.numpy())

    x64 = x.astype(np.float64)
    mu, var = x64.mean(0), x64.var(0)
    np.testing.assert_allclose(got, (x64 - mu) / np.sqrt(var + 1e-3),
                               atol=1e-6 * (abs(mean) + std) ** 2 / std)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.01 * mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.99 + 0.01 * var,
                               rtol=1e-6 * (abs(mean) + std) ** 2 / std ** 2)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_custom_loop_sums_and_means_of_counts_losses_and_accuracies_are_exact(setting):
    gfar, strategy = mirrored(**SETTINGS[setting])
    per_replica = {
        "count": [3001.0, 3001.0], "loss": [12345.678, 1.5], "accuracy": [0.25, 0.75],
        "tiny": [1e-8, 3e-8]}

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            r = ctx.replica_id_in_sync_group
            out = {}
            for name, values in per_replica.items():
                v = tf.identity(tf.gather(tf.constant(values, tf.float32), r))
                out[name + "_sum"] = ctx.all_reduce("sum", v)
                out[name + "_mean"] = ctx.all_reduce("mean", v)
            for dtype in (tf.float16, tf.bfloat16):
                v = tf.identity(tf.cast(tf.gather(tf.constant([1.5, 2.5]), r), dtype))
                out[dtype.name + "_mean"] = ctx.all_reduce("mean", v)
            out["vector_sum"] = ctx.all_reduce("sum", tf.identity(tf.fill([9], 1e5 + tf.cast(r, tf.float32))))
            return out
        return strategy.run(fn)

    out = {k: strategy.experimental_local_results(v)[0].numpy() for k, v in step().items()}
    for name, values in per_replica.items():
        assert out[name + "_sum"] == np.float32(values[0]) + np.float32(values[1]), name
        assert out[name + "_mean"] == (np.float32(values[0]) + np.float32(values[1])) / 2, name
    assert out["count_sum"] == 6002.0
    assert float(out["float16_mean"]) == 2.0 and float(out["bfloat16_mean"]) == 2.0
    np.testing.assert_array_equal(out["vector_sum"], np.full(9, 200001.0, np.float32))
    if gfar is not None:
        assert gfar.stats.result()["steps"] == 0    # nothing went through GradientFlow


def test_the_keras_wing_is_reachable_from_the_package_as_the_docs_say():
    import gf_tf as fresh   # pylint: disable=reimported
    fresh.keras.install()
    assert "keras" in dir(fresh) and "keras_compat" not in dir(fresh)


# --- state per variable set ------------------------------------------------------------

def _linear_grads(rng, steps, num_replicas, n):
    """Per step, per replica, the gradient c of loss = sum(v * c): distinct, with ties avoided."""
    return rng.normal(size=(steps, num_replicas, n)).astype(np.float32)


def test_two_same_shaped_models_with_their_own_optimizers_keep_their_own_csc_state():
    """CycleGAN's two generators: identical shapes, one strategy, two optimizers. Each
    model's reduced gradient must equal its own CSC reference, step after step."""
    sparsity = gf_tf.ChunkSparsity(density=0.5, chunk_size=4)
    gfar, strategy = mirrored(compression=None, sparsity=sparsity)
    rng = np.random.default_rng(7)
    grads = {"a": _linear_grads(rng, 5, 2, 8), "b": _linear_grads(rng, 5, 2, 8) * 10}
    with strategy.scope():
        variables = {m: keras.Variable(np.zeros(8, np.float32), name=f"kernel_{m}") for m in grads}
        optimizers = {m: keras.optimizers.SGD(1.0) for m in grads}
    refs = {m: NumpyCSC(8, 2, 4) for m in grads}

    @tf.function
    def step(c_a, c_b):
        def fn(c_a, c_b):
            for m, c in (("a", c_a), ("b", c_b)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(variables[m] * c)
                g = tape.gradient(loss, [variables[m]])
                optimizers[m].apply_gradients(zip(g, [variables[m]]))
        strategy.run(fn, args=(c_a, c_b))

    for t in range(5):
        before = {m: variables[m].numpy().copy() for m in grads}
        values = [strategy.experimental_distribute_values_from_function(
            lambda ctx, m=m: tf.constant(grads[m][t][ctx.replica_id_in_sync_group]))
            for m in ("a", "b")]
        step(*values)
        for m in grads:
            want, _ = refs[m].step(grads[m][t], 0.5)
            np.testing.assert_allclose(before[m] - variables[m].numpy(), want, rtol=1e-6,
                                       atol=1e-6, err_msg=f"model {m}, step {t}")
    assert len(gfar.states()) == 2


def test_two_tf_functions_and_a_retrace_keep_their_own_state(caplog):
    """A critic (8 elements) and a generator (12) all-reduced from two tf.functions in a
    custom loop, alternating; the critic's function retraces for a new input signature
    (a smaller last batch) and keeps its residuals."""
    gfar, strategy = mirrored(compression=None,
                              sparsity=gf_tf.ChunkSparsity(density=0.25, chunk_size=4))
    rng = np.random.default_rng(11)
    sizes = {"critic": 8, "generator": 12}
    variables = {m: [tf.Variable(np.zeros(n, np.float32), name=m)] for m, n in sizes.items()}
    refs = {m: NumpyCSC(n, 2, 4) for m, n in sizes.items()}

    def make_step(m):
        @tf.function
        def step(c, batch):
            def fn(c, batch):
                del batch   # only its shape matters: a new one retraces
                return gf_tf.all_reduce_gradients([tf.identity(c)], variables[m])[0]
            return strategy.run(fn, args=(c, batch))
        return step

    steps = {m: make_step(m) for m in sizes}
    for t in range(6):
        for m, n in sizes.items():
            g = _linear_grads(rng, 1, 2, n)[0]
            batch = tf.zeros([16 if t < 4 else 5, 3])      # calls 5 and 6 retrace
            c = strategy.experimental_distribute_values_from_function(
                lambda ctx, g=g: tf.constant(g[ctx.replica_id_in_sync_group]))
            out = strategy.experimental_local_results(steps[m](c, batch))
            want, _ = refs[m].step(g, 0.25)
            for o in out:
                np.testing.assert_allclose(o.numpy(), want, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{m}, call {t + 1}")
    assert steps["critic"].experimental_get_tracing_count() >= 2
    assert len(gfar.states()) == 2
    assert "starts again from zero" not in caplog.text


def test_custom_loop_apply_gradients_still_sends_fp16_packs():
    """optimizer.apply_gradients in a custom loop reaches GradientFlow through the Keras hook:
    the traced step sums one float16 pack of all 8*3 + 3 gradient elements (plus the
    slots of its 2 tensors' bounds, a step ahead), and the stats count those bytes and the
    first step's float32 retry."""
    gfar, strategy = mirrored(compression="fp16")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(tf.identity(x)) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn)

    step()
    graph_ops = step.get_concrete_function().graph.get_operations()
    half_sums = [op.outputs[0].shape.num_elements() for op in graph_ops
                 if op.type == "AddN" and op.get_attr("T") == tf.float16]
    assert half_sums == [8 * 3 + 3 + gf_tf.wire.ahead_slots(2)]
    stats = gfar.stats.result()
    assert stats["sent_bytes_per_step"] == fp16_pack_bytes(27, 2, 1)
    assert stats["dense_bytes_per_step"] == 4 * 27
