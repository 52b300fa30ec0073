"""gf_tf.keras.LocalSGD in model.fit under MirroredStrategy on 2 logical CPUs (one process):
local steps send nothing, meetings give every replica the same weights, H = 1 averaging is
synchronous SGD, and the outer step is checked against NumPy float64 references.

The wrapped ops are TF's ReductionToOneDevice: one process cannot host several strategies with
collectives (tests/test_cross_device_ops.py). tests/test_local_sgd_multiworker.py runs 2 workers."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import gf_tf
from gf_tf.keras import backup
from gf_tf.keras.local_sgd import DEFAULT_WARMUP_STEPS
from helpers import DEVICES, GRADIENT_SCALE

LR = 0.05
BATCH, STEPS = 16, 4      # 64 examples: 4 steps per epoch, 8 examples per replica


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype(np.float32)
    return x, (x @ rng.normal(size=(8, 3)) + 0.3).astype(np.float32)


def linear_model(compression=None, **optimizer_settings):
    """(gfar, strategy, model): Dense(3) on 8 features, MSE, SGD(LR), on 2 replicas."""
    gfar = gf_tf.GradientFlowAllReduce(compression=compression,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(LR, **optimizer_settings), loss="mse")
    return gfar, strategy, model


class PerReplicaWeights(keras.callbacks.Callback):
    """After every batch: per replica, its copy of the model's weights (listed after LocalSGD)."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.seen = strategy, []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([[r.numpy() for r in self.strategy.experimental_local_results(w.value)]
                          for w in self.model.weights])


def fit(model, callbacks, epochs=1):
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def reference(sync_every, outer, warmup_steps=0):
    """NumPy float64: the same fit of Dense(3) on 2 replicas, each replica its 8 rows of each batch;
    meetings every sync_every steps after the warm-up and at the epoch's last step."""
    x, y = (a.astype(np.float64) for a in data())
    keras.utils.set_random_seed(0)
    init = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)]).get_weights()
    weights = [[w.astype(np.float64) for w in init] for _ in range(2)]
    anchor, momentum, met_at = [w.copy() for w in weights[0]], [0.0, 0.0], 0

    def grad(w, rows):
        error = x[rows] @ w[0] + w[1] - y[rows]
        scale = GRADIENT_SCALE * 2.0 / error.size
        return [scale * x[rows].T @ error, scale * error.sum(axis=0)]

    for step in range(STEPS):
        rows = [slice(step * BATCH + 8 * r, step * BATCH + 8 * (r + 1)) for r in range(2)]
        grads = [grad(weights[r], rows[r]) for r in range(2)]
        if step < warmup_steps:
            grads = [[(a + b) / 2 for a, b in zip(*grads)]] * 2
        weights = [[w - LR * g for w, g in zip(weights[r], grads[r])] for r in range(2)]
        done = step + 1
        if done <= warmup_steps:
            anchor, met_at = [w.copy() for w in weights[0]], done
        elif done - met_at >= sync_every or done == STEPS:
            delta = [(a - w0 + a - w1) / 2 for a, w0, w1 in zip(anchor, *weights)]
            if outer == "nesterov":
                momentum = [0.9 * m - 0.7 * d for m, d in zip(momentum, delta)]
                anchor = [a + 0.9 * m - 0.7 * d for a, m, d in zip(anchor, momentum, delta)]
            else:
                anchor = [a - d for a, d in zip(anchor, delta)]
            weights, met_at = [[a.copy() for a in anchor] for _ in range(2)], done
    return weights[0]


@pytest.mark.parametrize("sync_every, outer, warmup_steps, meetings", [
    (2, "nesterov", 0, 2),     # DiLoCo's outer Nesterov step on the mean pseudo-gradient
    (3, None, 0, 2),           # averaging after step 3, then at the epoch's end (step 4)
    (2, "average", 1, 2),      # a synchronous warm-up step, then averaging after steps 3 and 4
])
def test_fit_matches_float64_reference(sync_every, outer, warmup_steps, meetings):
    _, _, model = linear_model()
    local_sgd = gf_tf.keras.LocalSGD(sync_every, outer_optimizer=outer, warmup_steps=warmup_steps)
    fit(model, [local_sgd])
    for got, want in zip(model.get_weights(), reference(sync_every, outer, warmup_steps)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert local_sgd.meetings == meetings


def test_steps_per_execution_meets_at_the_first_batch_end_after_h_steps():
    """steps_per_execution=2 with H = 2: Keras's batch ends fall after steps 2 and 4, the meetings'."""
    gfar = gf_tf.GradientFlowAllReduce(cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", steps_per_execution=2)
    local_sgd = gf_tf.keras.LocalSGD(2, outer_optimizer="nesterov", warmup_steps=0)
    fit(model, [local_sgd])
    for got, want in zip(model.get_weights(), reference(2, "nesterov")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert local_sgd.meetings == 2


def test_by_default_the_first_steps_are_synchronous():
    """DEFAULT_WARMUP_STEPS (50) synchronous steps first: a 4-step fit with H = 2 never trains
    alone, and equals the fit without LocalSGD bit for bit."""
    _, _, synchronous = linear_model()
    fit(synchronous, [])
    _, _, local = linear_model()
    local_sgd = gf_tf.keras.LocalSGD(2)
    fit(local, [local_sgd])
    assert local_sgd.warmup_steps == DEFAULT_WARMUP_STEPS == 50
    assert local_sgd.meetings == 0
    for got, want in zip(local.get_weights(), synchronous.get_weights()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("compression, tolerance", [(None, 1e-6), ("fp16", 2e-4)])
def test_averaging_every_step_is_synchronous_sgd(compression, tolerance):
    synchronous_gfar, _, synchronous = linear_model(compression)
    fit(synchronous, [])
    gfar, _, local = linear_model(compression)
    fit(local, [gf_tf.keras.LocalSGD(1, warmup_steps=0)])
    for got, want in zip(local.get_weights(), synchronous.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
    # 4 local steps and 4 meetings: per step the bytes of the synchronous step's all-reduce
    got, want = gfar.stats.result(), synchronous_gfar.stats.result()
    assert got["steps"] == want["steps"] == STEPS
    assert got["sent_bytes_per_step"] == want["sent_bytes_per_step"] > 0
    assert got["dense_bytes_per_step"] == want["dense_bytes_per_step"]


def test_replicas_differ_between_meetings_and_are_bitwise_equal_after():
    gfar, strategy, model = linear_model()
    record = PerReplicaWeights(strategy)
    fit(model, [gf_tf.keras.LocalSGD(3, outer_optimizer="nesterov", warmup_steps=0), record], epochs=2)
    equal = [all(r[0].tobytes() == r[1].tobytes() for r in step) for step in record.seen]
    # meetings after steps 3 and 4 (the epoch's end), then 7 and 8
    assert equal == [False, False, True, True, False, False, True, True]
    stats = gfar.stats.totals()
    elements = 8 * 3 + 3
    assert stats["steps"] == 8                            # meetings are not steps
    assert stats["sent_bytes"] == 4 * 4 * elements       # the meetings' float32 packs only
    assert stats["dense_bytes"] == 8 * 4 * elements      # a synchronous step's float32 each
    assert gfar.stats.result()["sent_bytes_per_step"] == 4 * 4 * elements / 8


def test_outer_state_is_saved_and_restored_with_the_weights(tmp_path):
    """A fit of 2 epochs against 1 epoch, save_weights, a new model + LocalSGD loading it, 1 epoch."""
    path = str(tmp_path / "diloco.weights.h5")
    _, _, straight = linear_model()
    fit(straight, [gf_tf.keras.LocalSGD(3, outer_optimizer="nesterov", warmup_steps=0)], epochs=2)
    _, _, first = linear_model()
    fit(first, [gf_tf.keras.LocalSGD(3, outer_optimizer="nesterov", warmup_steps=0)])
    first.save_weights(path)
    _, _, resumed = linear_model()
    local_sgd = gf_tf.keras.LocalSGD(3, outer_optimizer="nesterov", warmup_steps=0)
    fit(resumed, [local_sgd], epochs=0)    # builds the outer optimizer, then the restore reaches it
    resumed.load_weights(path)
    momentum = [v.numpy() for v in local_sgd.outer_optimizer.variables if "momentum" in v.path]
    assert momentum and all(np.any(m != 0) for m in momentum)
    fit(resumed, [local_sgd])
    for got, want in zip(resumed.get_weights(), straight.get_weights()):
        assert got.tobytes() == want.tobytes()


def test_backup_and_restore_gives_each_replica_its_own_inner_momentum(tmp_path):
    """Inner SGD with momentum 0.9, H = 3, 2 epochs of 4 steps: a fit stopped after epoch 1 with
    gf_tf's BackupAndRestore, resumed by a new model, ends bitwise as the uninterrupted fit, its
    two replicas' momenta included (they differ: each replica's own since the last meeting)."""
    def run(epochs, backup_dir=None):
        _, strategy, model = linear_model(momentum=0.9)
        local_sgd = gf_tf.keras.LocalSGD(3, outer_optimizer="nesterov", warmup_steps=0)
        callbacks = [local_sgd]
        if backup_dir:
            callbacks.append(backup.BackupAndRestore(backup_dir, delete_checkpoint=False))
        fit(model, callbacks, epochs=epochs)
        copies = [[c.numpy() for c in strategy.experimental_local_results(v.value)]
                  for v in model.optimizer.variables if "momentum" in v.path]
        return model, local_sgd, copies

    straight, _, straight_momenta = run(2)
    run(1, str(tmp_path))
    saved = dict(np.load(tmp_path / "gf_tf_local_sgd.worker0.npz"))
    assert int(saved["iterations"]) == 4
    assert saved["v1_r0"].tobytes() != saved["v1_r1"].tobytes()
    resumed, local_sgd, momenta = run(2, str(tmp_path))
    for got, want in zip(resumed.get_weights(), straight.get_weights()):
        assert got.tobytes() == want.tobytes()
    assert [[c.tobytes() for c in v] for v in momenta] == \
        [[c.tobytes() for c in v] for v in straight_momenta]
    assert local_sgd.restore_replica_state({**saved, "iterations": np.int64(3)}) == \
        "saved at step 3, the restored optimizer is at step 8"
    assert local_sgd.restore_replica_state({"iterations": np.int64(8)}) == \
        "saved for other optimizer variables or replicas"


def test_batch_norm_statistics_are_averaged_at_meetings():
    """A meeting only at the epoch's last batch: the moving statistics after it are the mean of the
    replicas' own (seen just before it by a callback listed first)."""
    gfar = gf_tf.GradientFlowAllReduce(cross_device_ops=tf.distribute.ReductionToOneDevice())
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    before = PerReplicaWeights(strategy)
    fit(model, [before, gf_tf.keras.LocalSGD(100, warmup_steps=0)])
    statistics = [i for i, w in enumerate(model.weights) if "moving" in w.path]
    assert len(statistics) == 2
    for i in statistics:
        replicas = [r.astype(np.float64) for r in before.seen[-1][i]]
        assert np.any(replicas[0] != replicas[1])
        np.testing.assert_allclose(model.weights[i].numpy(), (replicas[0] + replicas[1]) / 2,
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("reducer", ["csc", "lowrank"])
def test_compressed_pseudo_gradient_keeps_error_feedback_of_its_own(reducer):
    """CSC or LowRank on the meetings: the pseudo-gradient is a variable set of its own (the start
    point's), with its own residual; the replicas still leave every meeting bitwise equal."""
    settings = ({"sparsity": gf_tf.ChunkSparsity(density=0.25, chunk_size=4, warmup_steps=0)}
                if reducer == "csc" else {"reducer": gf_tf.reducers.LowRank(rank=1, warmup_steps=0)})
    gfar = gf_tf.GradientFlowAllReduce(cross_device_ops=tf.distribute.ReductionToOneDevice(),
                                       **settings)
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    record = PerReplicaWeights(strategy)
    fit(model, [gf_tf.keras.LocalSGD(2, warmup_steps=0), record])
    equal = [all(r[0].tobytes() == r[1].tobytes() for r in step) for step in record.seen]
    assert equal == [False, True, False, True]
    (name, state), = gfar.states().items()    # no gradient set: every step local
    assert "local_sgd_start" in name
    residuals = {k: v for k, v in state.to_arrays().items() if "residual" in k}
    assert residuals and any(np.any(v != 0) for v in residuals.values())


def test_compressed_pseudo_gradient_state_is_saved_and_restored(tmp_path):
    """The start point's reducer state (CSC's residuals; any reducer's goes the same way, the
    outer optimizer's own checkpoint object) is saved with the model's weights and restored:
    1 epoch, save_weights, a new model loading it and fitting 1 more epoch ends bitwise as a
    straight 2-epoch fit, and a new model that does not load it does not."""
    def run(epochs, load=None):
        gfar = gf_tf.GradientFlowAllReduce(
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
            sparsity=gf_tf.ChunkSparsity(density=0.25, chunk_size=4, warmup_steps=0))
        strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        local_sgd = gf_tf.keras.LocalSGD(2, outer_optimizer="nesterov", warmup_steps=0)
        fit(model, [local_sgd], epochs=0 if load else epochs)   # builds the outer optimizer
        if load:
            if load == "weights only":   # the same weights and optimizers, no reducer state
                model.set_weights(first.get_weights())
                for mine, theirs in zip(model.optimizer.variables, first.optimizer.variables):
                    mine.assign(theirs)
                for mine, theirs in zip(local_sgd.outer_optimizer.variables,
                                        first_outer.variables):
                    mine.assign(theirs)
            else:
                model.load_weights(load)
            fit(model, [local_sgd], epochs=epochs)
        return model, gfar, local_sgd.outer_optimizer

    straight, _, _ = run(2)
    first, first_gfar, first_outer = run(1)
    saved = {k: v for state in first_gfar.states().values() for k, v in state.to_arrays().items()}
    assert any("residual" in k and np.any(v != 0) for k, v in saved.items())
    path = str(tmp_path / "pseudo.weights.h5")
    first.save_weights(path)
    resumed, _, _ = run(1, load=path)
    for got, want in zip(resumed.get_weights(), straight.get_weights()):
        assert got.tobytes() == want.tobytes()
    without_state, _, _ = run(1, load="weights only")
    assert any(got.tobytes() != want.tobytes()
               for got, want in zip(without_state.get_weights(), straight.get_weights()))


@pytest.mark.parametrize("outer, warned", [("nesterov", True), ("average", False)])
def test_outer_momentum_over_error_feedback_is_warned(outer, warned, caplog):
    gfar = gf_tf.GradientFlowAllReduce(cross_device_ops=tf.distribute.ReductionToOneDevice(),
                                       sparsity=gf_tf.ChunkSparsity(density=0.5, chunk_size=4))
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    with caplog.at_level("WARNING", logger="gf_tf.keras.local_sgd"):
        fit(model, [gf_tf.keras.LocalSGD(2, outer_optimizer=outer, warmup_steps=0)], epochs=0)
    said = [r.getMessage() for r in caplog.records if "outer optimizer has momentum" in r.getMessage()]
    assert said == (["gf_tf: LocalSGD's outer optimizer has momentum 0.9 and the meetings go "
                     "through CSCReducer, whose error feedback already carries what a meeting "
                     "does not send: the two together diverged in gf_tf's measurements "
                     "(docs/local-sgd.md). Use outer_optimizer=\"average\" (or one without "
                     "momentum) with a compressing reducer."] if warned else [])


def test_later_fit_without_local_sgd_is_synchronous_again():
    gfar, strategy, model = linear_model()
    fit(model, [gf_tf.keras.LocalSGD(2, warmup_steps=0)])
    assert gfar.local_steps is None
    record = PerReplicaWeights(strategy)
    fit(model, [record])
    assert all(r[0].tobytes() == r[1].tobytes() for step in record.seen for r in step)


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, "sync_every must be an int >= 1"),
    ({"sync_every": 2.5}, "sync_every must be an int >= 1"),
    ({"sync_every": True}, "sync_every must be an int >= 1"),
    ({"sync_every": 2, "warmup_steps": -1}, "warmup_steps must be an int >= 0"),
    ({"sync_every": 2, "outer_optimizer": "adam"}, "outer_optimizer must be None, 'average'"),
    ({"sync_every": 2, "outer_optimizer": 0.7}, "outer_optimizer must be None, 'average'"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gf_tf.keras.LocalSGD(**kwargs)


def test_built_outer_optimizer_is_refused():
    outer = keras.optimizers.SGD(0.7)
    outer.build([keras.Variable(np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="unbuilt keras.optimizers.Optimizer"):
        gf_tf.keras.LocalSGD(2, outer_optimizer=outer, warmup_steps=0)


@pytest.mark.parametrize("strategy", [
    lambda: tf.distribute.MirroredStrategy(DEVICES[:2]),
    lambda: tf.distribute.get_strategy(),
])
def test_strategy_without_gradient_flow_is_refused(strategy):
    strategy = strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"cross_device_ops=gf_tf.GradientFlowAllReduce\(\)"):
        fit(model, [gf_tf.keras.LocalSGD(2, warmup_steps=0)])


def test_gradient_accumulation_is_refused():
    _, _, model = linear_model(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps does not combine"):
        fit(model, [gf_tf.keras.LocalSGD(2, warmup_steps=0)])


def test_local_steps_must_be_a_local_steps_object():
    with pytest.raises(TypeError, match="gf_tf.local_steps.LocalSteps"):
        gf_tf.GradientFlowAllReduce().local_steps = "every 4 steps"
