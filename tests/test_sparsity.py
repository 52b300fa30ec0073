"""CSC (gf_tf.ChunkSparsity) against a NumPy float64 model, on real TF collectives.

Every all-reduce here runs through gf_tf.GradientFlowAllReduce(sparsity=...)
inside tf.distribute.MirroredStrategy over 2 or 3 logical CPU devices. The
buffers travel through TF's ReductionToOneDevice: MirroredStrategy's
CollectiveAllReduce numbers its groups from the same key in every strategy
object, so one process cannot mix 2- and 3-device collective groups.
Collectives across processes are covered by test_sparsity_multiworker.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.csc import select_chunks, selected_chunk_count

from csc_reference import NumpyCSC, NumpyGlobalCSC, chunks_zero, flatten, pack_order
from helpers import DEVICES, Runner, all_ops, only_state, pack_states, three_pack_step


SUM = tf.distribute.ReduceOp.SUM


# --- k and selection -----------------------------------------------------------

def test_selected_chunk_count_for_10_chunks():
    assert [selected_chunk_count(10, d) for d in (0.25, 1.0, 1e-6)] == [3, 10, 1]


def test_selected_chunk_count_is_not_fooled_by_binary_rounding():
    assert 0.07 * 100 > 7  # 7.000000000000001
    assert selected_chunk_count(100, 0.07) == 7
    assert selected_chunk_count(0, 0.5) == 0
    assert selected_chunk_count(3, 0.9) == 3


def test_select_chunks_breaks_ties_by_lower_index_and_sorts():
    norms = tf.constant([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    assert select_chunks(norms, 2).numpy().tolist() == [1, 2]
    assert select_chunks(norms, 4).numpy().tolist() == [1, 2, 4, 5]
    assert select_chunks(tf.zeros([5]), 3).numpy().tolist() == [0, 1, 2]


def test_select_chunks_ranks_nan_and_inf_first():
    norms = tf.constant([5.0, np.nan, 1.0, np.inf])
    assert select_chunks(norms, 2).numpy().tolist() == [1, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(density=0.0), "density"), (dict(density=1.5), "density"),
    (dict(chunk_size=0), "chunk_size"), (dict(chunk_size=2.5), "chunk_size"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(momentum=1.0), "momentum"),
    (dict(warmup="linear"), "warmup"), (dict(selection="whole_model"), "selection"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gf_tf.ChunkSparsity(**kwargs)


def test_schedules_are_documented_functions_of_the_step():
    dense = gf_tf.ChunkSparsity(density=0.001, warmup_steps=400)
    assert dense.schedule() == ((0, 1.0), (400, 0.001))
    expo = gf_tf.ChunkSparsity(density=0.001, warmup_steps=400, warmup="exponential")
    assert expo.schedule() == ((0, 0.25), (100, 0.0625), (200, 0.015625),
                               (300, 0.00390625), (400, 0.001))
    assert [expo.density_at(s) for s in (0, 99, 100, 399, 400, 10**6)] == \
        [0.25, 0.25, 0.0625, 0.00390625, 0.001, 0.001]
    assert gf_tf.ChunkSparsity(density=0.3, warmup_steps=0).schedule() == ((0, 0.3),)


# --- the algorithm against NumPy ----------------------------------------------------

@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_matches_numpy_model_over_steps(num_replicas, momentum):
    cs, density, steps = 16, 0.1, 5
    shapes = [(7, 3), (1009,)]            # 1030 elements: 65 chunks, the last of 6
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=cs, momentum=momentum)
    run = Runner(num_replicas, csc)
    order = pack_order(shapes)
    model = NumpyCSC(1030, num_replicas, cs, momentum)
    rng = np.random.default_rng(num_replicas)
    for step in range(steps):
        # Chunk scales make the top-k well separated (no float32-vs-float64 near ties).
        scale = rng.permutation(np.repeat(np.linspace(0.1, 10.0, 65), cs)[:1030])
        grads = [[(rng.normal(size=s)).astype(np.float32) for s in shapes]
                 for _ in range(num_replicas)]
        for r in range(num_replicas):
            flat = flatten(grads[r], order) * scale
            sizes = [int(np.prod(shapes[i])) for i in order]
            parts = np.split(flat, np.cumsum(sizes)[:-1])
            for i, p in zip(order, parts):
                grads[r][i] = p.reshape(shapes[i]).astype(np.float32)
        out = run(grads)
        ref, idx = model.step([flatten(g, order) for g in grads], density)
        assert len(idx) == 7
        for r in range(num_replicas):
            got = flatten(out[r], order)
            np.testing.assert_array_equal(got, flatten(out[0], order))  # identical everywhere
            np.testing.assert_allclose(got, ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
            sent_chunks = np.flatnonzero(~chunks_zero(got, cs))
            np.testing.assert_array_equal(sent_chunks, idx)
        for r, residual in enumerate(run.residuals()):
            np.testing.assert_allclose(residual, model.residual[r], rtol=1e-5, atol=1e-4)
            np.testing.assert_array_equal(np.flatnonzero(chunks_zero(residual, cs)), idx)
        if momentum:
            for r, u in enumerate(run.state().velocities):
                np.testing.assert_allclose(u.numpy(), model.velocity[r], rtol=1e-5, atol=1e-4)
    assert int(run.state().step.numpy()) == steps


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_replicas_disagreeing_on_importance_select_the_same_chunks(num_replicas):
    # 6 chunks of 4; replica 0 is large in chunk 0, replica 1 in chunk 3.
    for density, expected in [(1 / 6, [3]), (2 / 6, [0, 3])]:
        csc = gf_tf.ChunkSparsity(density=density, chunk_size=4)
        run = Runner(num_replicas, csc)
        grads = [np.full(24, 0.01, np.float32) for _ in range(num_replicas)]
        grads[0][0:4] = 10.0
        grads[1][12:16] = 11.0
        out = run([[g] for g in grads])
        for r in range(num_replicas):
            np.testing.assert_array_equal(out[r][0], out[0][0])
            np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(out[r][0], 4)), expected)
        total = np.sum(grads, axis=0)
        for c in expected:
            np.testing.assert_allclose(out[0][0][4 * c:4 * c + 4], total[4 * c:4 * c + 4],
                                       rtol=1e-3)
        for r, residual in enumerate(run.residuals()):  # each replica keeps its own rest
            keep = ~np.isin(np.arange(24) // 4, expected)
            np.testing.assert_array_equal(residual[keep], grads[r][keep])
            np.testing.assert_array_equal(residual[~keep], 0.0)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_conservation_per_replica(num_replicas):
    """sum(sent) + final residual == sum(raw gradients), per replica, in float32.

    Replica r's gradient is nonzero only at positions p % num_replicas == r, so
    with a float32 wire the all-reduced output at those positions is exactly
    what replica r sent."""
    n, cs = 200, 8
    csc = gf_tf.ChunkSparsity(density=0.2, chunk_size=cs)
    run = Runner(num_replicas, csc, compression=None)
    rng = np.random.default_rng(7)
    owner = np.arange(n) % num_replicas
    sent = np.zeros([num_replicas, n], np.float32)
    raw = np.zeros([num_replicas, n], np.float32)
    for _ in range(6):
        grads = [np.where(owner == r, rng.normal(size=n), 0.0).astype(np.float32)
                 for r in range(num_replicas)]
        out = run([[g] for g in grads])
        for r in range(num_replicas):
            sent[r] += np.where(owner == r, out[0][0], 0.0)
            raw[r] += grads[r]
    for r, residual in enumerate(run.residuals()):
        np.testing.assert_array_equal(residual[owner != r], 0.0)
        np.testing.assert_allclose(sent[r] + residual, raw[r], rtol=1e-5, atol=1e-5)
        assert np.any(residual != 0)  # something is still held back


def test_residual_comes_from_own_accumulator_not_the_average():
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=1)
    run = Runner(2, csc)
    run([[np.array([1.0, 2.0, 30.0, 40.0], np.float32)], [np.array([5.0, 6.0, 7.0, 8.0],
                                                                     np.float32)]])
    r0, r1 = run.residuals()
    np.testing.assert_array_equal(r0, [1.0, 2.0, 0.0, 0.0])
    np.testing.assert_array_equal(r1, [5.0, 6.0, 0.0, 0.0])
    out = run([[np.array([0.0, 0.0, 0.0, 0.0], np.float32)],
               [np.array([0.0, 0.0, 0.0, 0.0], np.float32)]])
    np.testing.assert_array_equal(out[0][0], [6.0, 8.0, 0.0, 0.0])  # the residuals' sum


@pytest.mark.parametrize("compression", ["fp16", None])
def test_density_one_equals_the_dense_path(compression):
    """Density 1 sends every chunk: the dense result, exactly on a float32 wire. On FP16 the
    scale is per chunk (from its L1 norm) instead of per tensor, so the two round apart by
    at most one FP16 ulp of each term."""
    rng = np.random.default_rng(3)
    sparse = Runner(3, gf_tf.ChunkSparsity(density=1.0, chunk_size=16), compression)
    dense = Runner(3, None, compression)
    for _ in range(3):
        grads = [[rng.normal(size=(33, 5)).astype(np.float32) * 1e3,
                  rng.normal(size=(7,)).astype(np.float32)] for _ in range(3)]
        a, b = sparse(grads), dense(grads)
        for r in range(3):
            for k, (x, y) in enumerate(zip(a[r], b[r])):
                if compression is None:
                    np.testing.assert_array_equal(x, y)
                else:
                    terms = np.sum([np.abs(g[k]) for g in grads], axis=0)
                    np.testing.assert_allclose(x, y, rtol=0, atol=2 * 2 ** -10 * terms.max())
        assert a[0][0].dtype == np.float32
    assert not np.any(sparse.residuals()[0])


def test_partial_last_chunk_is_sent_whole_and_the_wire_stays_static():
    # 1009 elements in chunks of 16: the last chunk (63) holds 1 element.
    csc = gf_tf.ChunkSparsity(density=2 / 64, chunk_size=16)
    run = Runner(2, csc)
    g = np.full(1009, 0.01, np.float32)
    g[1008] = 1000.0
    g[0:16] = 5.0
    out = run([[g], [g]])
    expected = np.zeros(1009)
    expected[0:16] = 10.0
    expected[1008] = 2000.0
    np.testing.assert_array_equal(out[0][0], expected)
    # Next step: the last chunk is not selected; chunks 1 and 2 (residual 2 x 0.01 x 16).
    g2 = np.zeros(1009, np.float32)
    g2[16:48] = 1.0
    out = run([[g2], [g2]])
    np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(out[0][0], 16)), [1, 2])
    np.testing.assert_allclose(out[0][0][16:48], 2 * 1.01, rtol=1e-3)
    stats = run.gfar.stats.totals()
    # Per step: 64 float32 norms + 2 chunks x 16 float16 elements, padded when partial.
    assert stats["sent_bytes"] == 2 * (4 * 64 + 2 * 16 * 2)
    assert stats["dense_bytes"] == 2 * 4 * 1009


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_step_leaves_the_residual_as_it_was(bad):
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=1, momentum=0.5)
    run = Runner(2, csc)
    out = run([[np.array([bad, 1.0], np.float32)], [np.array([1.0, 1.0], np.float32)]])
    assert not np.isfinite(out[0][0][0])  # the overflow stays visible to the optimizer
    for r in range(2):
        np.testing.assert_array_equal(run.residuals()[r], [0.0, 0.0])
        np.testing.assert_array_equal(run.state().velocities[r].numpy(), [0.0, 0.0])
    out = run([[np.array([1.0, 1.0], np.float32)], [np.array([1.0, 1.0], np.float32)]])
    np.testing.assert_array_equal(out[0][0], [2.0, 0.0])   # tie: the lower chunk index
    for r in range(2):
        residual = run.residuals()[r]
        assert np.all(np.isfinite(residual))
        np.testing.assert_array_equal(residual, [0.0, 1.0])


# --- warm-up and statistics -------------------------------------------------------

def _per_step(run, grads, steps):
    rows, before = [], run.gfar.stats.totals()
    for _ in range(steps):
        run(grads)
        now = run.gfar.stats.totals()
        rows.append((now["sent_bytes"] - before["sent_bytes"],
                     now["selected_chunks"] - before["selected_chunks"]))
        before = now
    return rows


def test_dense_warmup_then_sparse():
    csc = gf_tf.ChunkSparsity(density=0.1, chunk_size=10, warmup_steps=2)
    run = Runner(2, csc)
    grads = [[np.arange(100, dtype=np.float32)], [np.ones(100, np.float32)]]
    rows = _per_step(run, grads, 4)
    dense, sparse = 4 * 10 + 100 * 2, 4 * 10 + 1 * 10 * 2   # chunk norms travel on every step
    assert rows == [(dense, 10), (dense, 10), (sparse, 1), (sparse, 1)]
    # Dense steps leave no residual; sparse step 3 sends chunk 9, step 4 chunk 8.
    expected = np.full(100, 2.0, np.float32)
    expected[80:90], expected[90:] = 0.0, 1.0
    np.testing.assert_array_equal(run.residuals()[1], expected)


def test_exponential_warmup_stages_send_k_per_stage():
    csc = gf_tf.ChunkSparsity(density=0.01, chunk_size=1, warmup_steps=3, warmup="exponential")
    assert csc.schedule() == ((0, 0.25), (1, 0.0625), (2, 0.015625), (3, 0.01))
    run = Runner(2, csc)
    grads = [[np.linspace(1, 2, 400).astype(np.float32)]] * 2
    rows = _per_step(run, grads, 5)
    ks = [100, 25, 7, 4, 4]
    assert [k for _, k in rows] == ks
    assert [b for b, _ in rows] == [4 * 400 + 2 * k for k in ks]


def test_stats_report_bytes_ratio_chunks_and_residual_l1():
    csc = gf_tf.ChunkSparsity(density=0.25, chunk_size=4)
    run = Runner(2, csc)
    g = np.arange(16, dtype=np.float32)
    run([[g], [g]])
    result = run.gfar.stats.result()
    assert result["steps"] == 1
    assert result["dense_bytes_per_step"] == 64
    assert result["sent_bytes_per_step"] == 4 * 4 + 4 * 2
    assert result["compression_ratio"] == pytest.approx(64 / 24)
    assert result["selected_chunks_per_step"] == 1
    assert result["total_chunks_per_step"] == 4
    assert result["residual_norm"] == pytest.approx(float(np.sum(g[:12])))


def test_a_changed_variable_list_resets_only_its_own_state_with_one_warning(caplog):
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=2)
    run = Runner(2, csc)
    run([[np.ones(8, np.float32)], [np.ones(8, np.float32)]])
    first = run.variables
    (old_name,) = run.gfar.states()
    run.variables = first + [tf.Variable(0.0, name="added")]    # the same list, one more
    run([[np.ones(8, np.float32), np.ones(2, np.float32)]] * 2)
    assert caplog.text.count("starts again from zero") == 1 and old_name in caplog.text
    (new_name,) = run.gfar.states()
    assert new_name != old_name and "added" in new_name
    assert int(run.state().step.numpy()) == 1


def test_variable_set_state_turns_into_arrays_and_back_and_names_what_does_not_fit():
    """Two packs (bytes_per_pack=1), momentum on, 2 replicas: one step counter per set and
    replica, recorded by every pack; residuals and velocities per pack and replica."""
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=2, momentum=0.9)
    run = Runner(2, csc, bytes_per_pack=1)
    rng = np.random.default_rng(3)
    run([[rng.normal(size=6).astype(np.float32), rng.normal(size=4).astype(np.float32)]
         for _ in range(2)])
    (variable_set,) = run.gfar.states().values()
    arrays = variable_set.to_arrays()
    assert sorted(arrays) == sorted([f"p{p}_{what}_r{r}" for p in range(2) for r in range(2)
                                     for what in ("step", "residual", "velocity")]
                                    + ["p0_residual_l1", "p1_residual_l1"])
    assert variable_set.pack_states[0].steps is variable_set.pack_states[1].steps is variable_set.shared.steps
    assert all(int(arrays[f"p{p}_step_r{r}"]) == 1 for p in range(2) for r in range(2))
    saved = {k: np.array(v) for k, v in arrays.items()}
    run([[np.ones(6, np.float32), np.ones(4, np.float32)]] * 2)
    variable_set.assign_arrays(saved)
    for key, value in variable_set.to_arrays().items():
        np.testing.assert_array_equal(value, saved[key])
    with pytest.raises(ValueError, match=r"missing \['p1_velocity_r0'\], extra \['p9_x'\]"):
        variable_set.assign_arrays({**{k: v for k, v in saved.items() if k != "p1_velocity_r0"},
                                    "p9_x": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'p0_residual_r1' .* shape \(5,\), the state has \(4,\)"):
        variable_set.assign_arrays({**saved, "p0_residual_r1": np.zeros(5, np.float32)})


def test_state_variables_are_plain_local_variables_on_each_replica_device():
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=2, momentum=0.9)
    run = Runner(3, csc)
    with run.strategy.scope():  # as Keras does around fit
        run([[np.ones(8, np.float32)]] * 3)
    state = run.state()
    for r, (res, vel) in enumerate(zip(state.residuals, state.velocities)):
        assert not isinstance(res, tf.distribute.DistributedValues)
        assert res.device.endswith(f"CPU:{r}") and vel.device.endswith(f"CPU:{r}")
        assert res.dtype == tf.float32 and res.shape == [8]


# --- Keras: statistics callback and restarts -----------------------------------------


def _keras_setup(sparsity, seed=0):
    gfar = gf_tf.GradientFlowAllReduce(sparsity=sparsity,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).astype(np.float32)
    return gfar, model, x, y


def test_gradient_flow_stats_in_fit_history_and_tensorboard(tmp_path):
    csc = gf_tf.ChunkSparsity(density=0.1, chunk_size=8, warmup_steps=2)
    gfar, model, x, y = _keras_setup(csc)
    n = model.count_params()   # 8*16 + 16 + 16*3 + 3 = 195 elements, one pack, 25 chunks
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        gf_tf.GradientFlowStats(gfar), keras.callbacks.TensorBoard(str(tmp_path))])
    h = history.history
    c, k = 25, 3
    dense_step, sparse_step = 4 * c + 2 * n, 4 * c + 2 * k * 8
    assert h["gf_dense_bytes_per_step"] == [4 * n, 4 * n]
    # Epoch 1: 2 dense warm-up steps + 2 sparse; epoch 2: 4 sparse.
    assert h["gf_sent_bytes_per_step"] == [(2 * dense_step + 2 * sparse_step) / 4, sparse_step]
    assert h["gf_selected_chunks_per_step"] == [(2 * c + 2 * k) / 4, k]
    assert h["gf_compression_ratio"][1] == pytest.approx(4 * n / sparse_step)
    assert h["gf_residual_norm"][1] > 0
    events = tf.io.gfile.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    tags = {v.tag for e in events for record in tf.compat.v1.train.summary_iterator(e)
            for v in record.summary.value}
    assert "epoch_gf_compression_ratio" in tags and "epoch_gf_sent_bytes_per_step" in tags


def test_gradient_flow_stats_rejects_objects_without_stats():
    with pytest.raises(TypeError, match="GradientFlowAllReduce"):
        gf_tf.GradientFlowStats(object())


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("simulated preemption")


def test_backup_and_restore_resumes_csc_state_without_a_second_warmup(tmp_path):
    """CSC state is checkpointed with the optimizer (gf_tf.keras.checkpoint): a restarted
    job (new process: new strategy, GradientFlowAllReduce and ChunkSparsity)
    resumes from the backup of epoch 0 with its residuals and step counter, so
    the warm-up is not run again."""
    def csc():
        return gf_tf.ChunkSparsity(density=0.1, chunk_size=8, warmup_steps=3)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    sparsity = csc()
    gfar, model, x, y = _keras_setup(sparsity)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                  callbacks=[backup, _Interrupt(epoch=1, batch=1)])
    state = only_state(gfar)
    assert int(state.step.numpy()) == 6 and np.any(state.residuals[0].numpy())

    sparsity2 = csc()  # the restarted job
    gfar2, model2, _, _ = _keras_setup(sparsity2, seed=1)
    backup2 = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    history = model2.fit(x, y, batch_size=16, epochs=3, verbose=0,
                         callbacks=[backup2, gf_tf.GradientFlowStats(gfar2)])
    assert history.epoch == [1, 2]                      # resumed after epoch 0
    state2 = only_state(gfar2)
    assert int(state2.step.numpy()) == 4 + 8            # counted on from the backup's 4
    # Every step after the restart is sparse (3 of 25 chunks): no second warm-up.
    assert history.history["gf_selected_chunks_per_step"] == [3, 3]


def _digits_accuracy(sparsity, epochs, seed=0):
    """Test accuracy of a 64-64-10 MLP on sklearn's digits, 2 replicas, SGD momentum 0.9
    (in the optimizer when dense, as CSC momentum correction when sparse)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, data.target, test_size=0.2,
                                                        random_state=seed)
    gfar = gf_tf.GradientFlowAllReduce(
        compression=None if sparsity is None else "fp16", sparsity=sparsity,
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.0 if sparsity else 0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, shuffle=True, verbose=0)
    return model.evaluate(x_test, y_test, verbose=0)[1], gfar.stats.result()


def test_digits_mlp_learns_through_csc_alone():
    """Small, fast cousin of benchmarks/convergence.py (which compares against dense
    float32 on 2 workers): no warm-up, 4810 parameters in 301 chunks of 16, 31 sent
    per step, 8 epochs. Measured: dense float32 with SGD momentum 0.9 0.953, this
    0.950, the same without momentum anywhere 0.922."""
    accuracy, stats = _digits_accuracy(
        gf_tf.ChunkSparsity(density=0.1, chunk_size=16, momentum=0.9), epochs=8)
    assert accuracy > 0.935, accuracy
    assert stats["selected_chunks_per_step"] == 31 and stats["total_chunks_per_step"] == 301


def test_freezing_a_layer_between_fits_resets_csc_state_with_a_warning(caplog):
    csc = gf_tf.ChunkSparsity(density=0.1, chunk_size=8, warmup_steps=1)
    gfar, model, x, y = _keras_setup(csc)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    (first_key,) = gfar.states()
    assert int(only_state(gfar).step.numpy()) == 4
    model.layers[0].trainable = False
    with model.distribute_strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert caplog.text.count("starts again from zero") == 1 and first_key in caplog.text
    (second_key,) = gfar.states()
    state = only_state(gfar)
    assert second_key != first_key
    assert state.residuals[0].shape == [16 * 3 + 3]     # only the last layer's gradients
    assert int(state.step.numpy()) == 4                 # a fresh warm-up, counted from 0


def test_mixed_float16_with_loss_scaling_trains_through_csc():
    """Keras unscales the gradients before the all-reduce: residuals hold true gradients."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        csc = gf_tf.ChunkSparsity(density=0.1, chunk_size=8, warmup_steps=1, momentum=0.9)
        gfar, model, x, y = _keras_setup(csc)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    state = only_state(gfar)
    assert int(state.step.numpy()) == 8
    residual = state.residuals[0].numpy()
    assert np.all(np.isfinite(residual)) and 0 < np.abs(residual).max() < 100
    assert np.isfinite(history.history["loss"][-1])
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.parametrize("selection, chunk_elements", [("per_pack", 24), ("global", 20)])
def test_several_packs_travel_in_two_collectives_per_step(selection, chunk_elements):
    """Three packs (bytes_per_pack=16 wire bytes: one tensor each): all chunk norms in one float32
    all-reduce, all selected chunks in one more all-reduce (float32 wire here), whatever the
    number of packs; per pack each selects its own top-k, global one top-K over all 10 chunks,
    each against its reference."""
    sizes = [12, 8, 20]
    gfar, strategy, step = three_pack_step(
        gf_tf.ChunkSparsity(density=0.5, chunk_size=4, selection=selection), sizes)
    rng = np.random.default_rng(5)
    refs, order = [NumpyCSC(n, 2, 4) for n in sizes], [2, 1, 0]   # packs in backprop order
    ref_global = NumpyGlobalCSC([sizes[i] for i in order], 2, 4)
    for _ in range(3):
        grads = [rng.normal(size=(2, n)).astype(np.float32) for n in sizes]
        values = [strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: tf.constant(g[ctx.replica_id_in_sync_group])) for g in grads]
        out = step(*values)
        if selection == "global":
            wants, _ = ref_global.step([grads[i] for i in order], 0.5)
            wants = [wants[order.index(k)] for k in range(3)]
        else:
            wants = [ref.step(g, 0.5)[0] for ref, g in zip(refs, grads)]
        for k, want in enumerate(wants):
            for o in strategy.experimental_local_results(out[k]):
                np.testing.assert_allclose(o.numpy(), want, rtol=1e-6, atol=1e-6)
    (variable_set,) = gfar.states().values()
    assert [pack.indices for pack in variable_set.pack_specs] == [(i,) for i in order]
    graph = step.get_concrete_function(*values).graph
    vector_sums = sorted((op.get_attr("T").name, op.outputs[0].shape.num_elements())
                         for op in all_ops(graph) if op.type == "AddN"
                         and op.outputs[0].shape.num_elements() not in (None, 1))
    # norms: 3 + 2 + 5 chunks; chunks: per pack (2 + 1 + 3) x 4 elements, global 5 x 4.
    assert vector_sums == sorted([("float32", 10), ("float32", chunk_elements)]), vector_sums


# --- selection="global": one top-K over the chunks of all packs ---------------------------


def test_selection_is_in_the_config_repr_and_cross_worker_fingerprint():
    per_pack, whole = gf_tf.ChunkSparsity(), gf_tf.ChunkSparsity(selection="global")
    assert per_pack.selection == "per_pack" and per_pack.get_config()["selection"] == "per_pack"
    assert whole.get_config()["selection"] == "global" and "selection='global'" in repr(whole)
    assert _sparsity_fingerprint(per_pack) != _sparsity_fingerprint(whole)


def _sparsity_fingerprint(sparsity):
    """The CRC32 the cross-worker handshake compares for these sparsity settings."""
    ((name, number, _),) = [s for s in sparsity.reducer().settings()
                            if s[0] == "sparsity settings (CRC32)"]
    return number


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_global_selection_matches_numpy_model_over_steps(num_replicas, momentum):
    """Four packs (bytes_per_pack=1: one tensor each) of 1009 = 63 x 16 + 1, 7, 1 and
    40 = 2 x 16 + 8 elements: 64 + 1 + 1 + 3 = 69 chunks, K = 7 at density 0.1 (per pack it
    would be 7 + 1 + 1 + 1). Step 0 makes the 1009 pack hold all 7 top chunks (the others send
    none), step 1 the three small packs 5 of them, later steps are random."""
    cs, density, sizes = 16, 0.1, [1009, 7, 1, 40]
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=cs, momentum=momentum,
                              selection="global")
    run = Runner(num_replicas, csc, bytes_per_pack=1)
    chunks = [-(-n // cs) for n in sizes]
    rng = np.random.default_rng(10 + num_replicas)
    model, order = None, None
    for step in range(5):
        if step == 0:
            scales = [rng.permutation(np.linspace(10, 20, 64)), [0.01], [0.01], [0.01] * 3]
        elif step == 1:
            scales = [np.full(64, 0.1), [1000.0], [3000.0], [500.0, 600.0, 700.0]]
        else:
            flat = rng.permutation(np.linspace(0.1, 10.0, 69))
            scales = np.split(flat, np.cumsum(chunks)[:-1])
        # |g| in [0.5, 1.5] times a scale per chunk: well separated norms, no near ties.
        grads = [[(rng.choice([-1, 1], n) * rng.uniform(0.5, 1.5, n)
                   * np.repeat(sc, cs)[:n]).astype(np.float32) for n, sc in zip(sizes, scales)]
                 for _ in range(num_replicas)]
        out = run(grads)
        if model is None:
            order, states = pack_states(run)
            model = NumpyGlobalCSC([sizes[i] for i in order], num_replicas, cs, momentum)
        refs, shares = model.step([np.stack([g[i] for g in grads]) for i in order], density)
        assert sum(len(s) for s in shares) == 7
        by_tensor = dict(zip(order, shares))
        if step == 0:
            assert [len(by_tensor[i]) for i in range(4)] == [7, 0, 0, 0]
        if step == 1:
            assert [len(by_tensor[i]) for i in range(4)] == [2, 1, 1, 3]
        for ref, i in zip(refs, order):
            for r in range(num_replicas):
                got = out[r][i].astype(np.float64)
                np.testing.assert_array_equal(got, out[0][i])     # identical everywhere
                np.testing.assert_allclose(got, ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
                np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(got, cs)), by_tensor[i])
        for p, (state, ref) in enumerate(zip(states, model.packs)):
            for r in range(num_replicas):
                residual = state.residuals[r].numpy()
                np.testing.assert_allclose(residual, ref.residual[r], rtol=1e-5, atol=1e-4)
                if momentum:
                    np.testing.assert_allclose(state.velocities[r].numpy(), ref.velocity[r],
                                               rtol=1e-5, atol=1e-4)
    totals = run.gfar.stats.totals()
    assert totals["selected_chunks"] == 5 * 7
    # Per step: 69 float32 norms + K = 7 chunks of 16 float16 elements (padded as one buffer).
    assert totals["sent_bytes"] == 5 * (4 * 69 + 2 * 7 * cs)


def test_global_selection_ties_go_to_the_first_packs_and_a_pack_may_send_all_or_nothing():
    """Two packs of 8 elements in chunks of 4 (4 chunks, K = 2 at density 0.5), float32 wire.
    Equal norms: the 2 chunks of the first pack in pack order; next step, zero gradients:
    only the second pack's residual is left, and it sends both chunks."""
    csc = gf_tf.ChunkSparsity(density=0.5, chunk_size=4, selection="global")
    run = Runner(2, csc, compression=None, bytes_per_pack=1)
    ones = [np.ones(8, np.float32), np.ones(8, np.float32)]
    out = run([ones, ones])
    (first, second), states = pack_states(run)
    np.testing.assert_array_equal(out[0][first], np.full(8, 2.0))
    np.testing.assert_array_equal(out[0][second], np.zeros(8))
    for r in range(2):
        np.testing.assert_array_equal(states[0].residuals[r].numpy(), np.zeros(8))
        np.testing.assert_array_equal(states[1].residuals[r].numpy(), np.ones(8))
    zeros = [np.zeros(8, np.float32)] * 2
    out = run([zeros, zeros])
    for r in range(2):
        np.testing.assert_array_equal(out[r][first], np.zeros(8))
        np.testing.assert_array_equal(out[r][second], np.full(8, 2.0))
        np.testing.assert_array_equal(states[1].residuals[r].numpy(), np.zeros(8))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_global_selection_sends_a_non_finite_chunk_and_keeps_only_that_packs_state(bad):
    """Two packs of 4 elements in chunks of 2 (4 chunks, K = 1). The non-finite chunk ranks
    first, so the other pack's much larger chunks wait; its pack keeps residual and velocity,
    the other pack commits its step (as per pack: the finite check is the pack's)."""
    csc = gf_tf.ChunkSparsity(density=0.25, chunk_size=2, momentum=0.5, selection="global")
    run = Runner(2, csc, compression=None, bytes_per_pack=1)
    g0 = [np.array([bad, 1.0, 1.0, 1.0], np.float32), np.full(4, 9.0, np.float32)]
    g1 = [np.ones(4, np.float32), np.full(4, 9.0, np.float32)]
    out = run([g0, g1])
    order, states = pack_states(run)
    model = NumpyGlobalCSC([4, 4], 2, 2, momentum=0.5)
    _, shares = model.step([np.stack([g0[i], g1[i]]) for i in order], 0.25)
    assert not np.isfinite(out[0][0][0]) and not np.isfinite(out[1][0][0])
    np.testing.assert_array_equal(out[0][0][2:], 0.0)
    np.testing.assert_array_equal(out[0][1], 0.0)
    p_bad, p_ok = order.index(0), order.index(1)
    assert list(shares[p_bad]) == [0] and len(shares[p_ok]) == 0
    for r, g in enumerate((g0, g1)):
        np.testing.assert_array_equal(states[p_bad].residuals[r].numpy(), 0.0)
        np.testing.assert_array_equal(states[p_bad].velocities[r].numpy(), 0.0)
        np.testing.assert_array_equal(states[p_ok].residuals[r].numpy(), g[1])
        np.testing.assert_array_equal(states[p_ok].velocities[r].numpy(), g[1])
    g = [np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.ones(4, np.float32)]
    out = run([g, g])
    refs, _ = model.step([np.stack([g[i], g[i]]) for i in order], 0.25)
    for ref, i in zip(refs, order):
        np.testing.assert_allclose(out[0][i], ref, rtol=1e-6)
    for p, ref in enumerate(model.packs):
        for r in range(2):
            np.testing.assert_allclose(states[p].residuals[r].numpy(), ref.residual[r], rtol=1e-6)
            np.testing.assert_allclose(states[p].velocities[r].numpy(), ref.velocity[r], rtol=1e-6)


def test_global_selection_after_dense_warmup_sends_k_of_all_chunks():
    """Packs of 100, 55 and 1 elements in chunks of 10: 10 + 6 + 1 = 17 chunks. After 2 dense
    steps K = ceil(0.1 x 17) = 2 chunks in all (per pack: 1 + 1 + 1), matching the reference."""
    csc = gf_tf.ChunkSparsity(density=0.1, chunk_size=10, warmup_steps=2, momentum=0.9,
                              selection="global")
    run = Runner(2, csc, bytes_per_pack=1)
    sizes = [100, 55, 1]
    rng = np.random.default_rng(4)
    model, rows, before = None, [], run.gfar.stats.totals()
    for step in range(5):
        scale = [np.repeat(rng.permutation(np.linspace(1, 3, 17))[:10], 10),
                 np.repeat(rng.uniform(1, 3, 6), 10)[:55], [20.0]]
        grads = [[(rng.uniform(0.5, 1.5, n) * sc).astype(np.float32)
                  for n, sc in zip(sizes, scale)] for _ in range(2)]
        out = run(grads)
        now = run.gfar.stats.totals()
        rows.append((now["sent_bytes"] - before["sent_bytes"],
                     now["selected_chunks"] - before["selected_chunks"]))
        before = now
        if model is None:
            order, states = pack_states(run)
            model = NumpyGlobalCSC([sizes[i] for i in order], 2, 10, momentum=0.9)
        refs, shares = model.step([np.stack([g[i] for g in grads]) for i in order],
                                  csc.density_at(step))
        assert (shares is None) == (step < 2)
        for ref, i in zip(refs, order):
            np.testing.assert_allclose(out[1][i], ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
        for state, ref in zip(states, model.packs):
            np.testing.assert_allclose(state.residuals[0].numpy(), ref.residual[0],
                                       rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(state.velocities[1].numpy(), ref.velocity[1],
                                       rtol=1e-5, atol=1e-4)
    dense, sparse = 4 * 17 + 2 * 156, 4 * 17 + 2 * 2 * 10
    assert rows == [(dense, 17), (dense, 17), (sparse, 2), (sparse, 2), (sparse, 2)]
