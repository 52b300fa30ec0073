"""density="auto"'s two safeguards: a sparse rung only where it saves enough of the step
(`choose_rung(min_saving=)`), and dense steps while the gradient is in a critical regime
(`regime_update`, Accordion's test), with its state saved and restored.

The rule's pure functions are checked against NumPy float64; the traced step runs real
MirroredStrategy over 2 logical CPUs with an injected clock (as test_auto_density.py) and is
checked against the float64 CSC reference.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.csc import AutoDensity, choose_rung
from gf_tf.csc.auto import INITIAL_REGIME, REGIME_KEY, regime_update
from csc_reference import NumpyCSC
from helpers import Runner, regression_data, small_keras_model
from test_auto_density import FakeClock

RUNG_BYTES = (1024.0, 512.0, 256.0, 128.0)


# --- the price: compress only where it pays ---------------------------------------------

@pytest.mark.parametrize("comm_seconds, min_saving, expected", [
    # 1 s of compute, budget 0.01 s: only the floor "fits" (or none: the floor). The floor
    # saves 7/8 of c_0 = comm_seconds.
    (0.05, 0.1, 0),     # saves 0.04375 s < 0.1 x 1.05 s: a small gradient stays dense
    (0.05, 0.0, 3),     # no minimum saving: the floor, as the price alone says
    (0.125, 0.1, 0),    # saves 0.109 s < 0.1125 s
    (0.25, 0.1, 3),     # saves 0.219 s >= 0.125 s
    (8.0, 0.5, 3),      # saves 7 s >= 4.5 s
    (1.0, 0.5, 0),      # saves 0.875 s < 1.0 s
])
def test_a_sparse_rung_is_taken_only_if_it_saves_min_saving_of_the_dense_step(
        comm_seconds, min_saving, expected):
    rung = choose_rung(1.0, comm_seconds, 1024.0, RUNG_BYTES, budget=0.01, min_saving=min_saving)
    assert int(rung) == expected
    c = comm_seconds * np.array(RUNG_BYTES) / 1024.0   # float64 reference
    first = next((i for i, ci in enumerate(c) if ci <= 0.01), 3)
    assert expected == (first if c[0] - c[first] >= min_saving * (1.0 + c[0]) else 0)


def test_the_saving_is_measured_against_the_rung_the_budget_chose():
    """Compute 1 s, 0.5 s measured at 1024 B, budget 0.3: rung 1 (0.25 s) fits and saves
    0.25 s of the dense step's 1.5 s (16.7%): taken at min_saving 0.1, not at 0.2."""
    assert int(choose_rung(1.0, 0.5, 1024.0, RUNG_BYTES, budget=0.3, min_saving=0.1)) == 1
    assert int(choose_rung(1.0, 0.5, 1024.0, RUNG_BYTES, budget=0.3, min_saving=0.2)) == 0


# --- the critical-regime test -------------------------------------------------------------

def numpy_regime(norms, window, change):
    """float64 reference of regime_update over a sequence: the flag after each step."""
    total, steps, previous, critical, flags = 0.0, 0, 0.0, 1.0, []
    for g in norms:
        if np.isfinite(g):
            total, steps = total + g, steps + 1
            if steps >= window:
                mean = total / steps
                critical = float(previous <= 0 or abs(mean - previous) >= change * previous)
                total, steps, previous = 0.0, 0, mean
        flags.append(critical)
    return flags


def run_regime(norms, window, change):
    regime, flags = tf.constant(INITIAL_REGIME, tf.float64), []
    for g in norms:
        regime = regime_update(regime, tf.constant(g, tf.float32), window, change)
        flags.append(float(regime[3]))
    return flags, regime


def test_regime_is_critical_until_two_windows_agree_then_follows_the_change():
    steady = [10.0] * 6
    flags, _ = run_regime(steady + [13.0] * 3 + [13.0] * 3, window=3, change=0.2)
    # windows: 10 (no previous: critical), 10 (same: calm), 13 (+30%: critical), 13 (calm)
    assert flags == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]


def test_a_non_finite_norm_leaves_the_regime_as_it_was():
    flags, regime = run_regime([5.0, 5.0, np.nan, np.inf, 5.0, 5.0], window=2, change=0.2)
    assert flags == [1, 1, 1, 1, 1, 0]
    np.testing.assert_array_equal(regime.numpy(), [0.0, 0.0, 5.0, 0.0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regime_matches_the_float64_reference_on_random_norms(seed):
    rng = np.random.default_rng(seed)
    norms = np.exp(rng.normal(size=200) * rng.choice([0.05, 0.5], size=200)).astype(np.float32)
    norms[rng.integers(0, 200, 5)] = np.nan
    flags, _ = run_regime(norms, window=7, change=0.2)
    assert flags == numpy_regime(norms.astype(np.float64), 7, 0.2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_saving=1.0), "min_saving"), (dict(min_saving=-0.1), "min_saving"),
    (dict(min_saving=float("nan")), "min_saving"), (dict(regime_window=-1), "regime_window"),
    (dict(regime_window=2.0), "regime_window"), (dict(regime_window=True), "regime_window"),
    (dict(regime_change=0.0), "regime_change"), (dict(regime_change=float("inf")), "regime_change"),
    (dict(min_chunks=0), "min_chunks"), (dict(min_chunks=2.0), "min_chunks"),
])
def test_bad_guard_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoDensity(**kwargs)


def test_config_shows_the_guard_settings_only_where_they_differ():
    assert AutoDensity().config() == {"min_density": 0.01, "auto_budget": 0.05}
    assert AutoDensity(min_saving=0.0, regime_window=0).config() == {
        "min_density": 0.01, "auto_budget": 0.05, "min_saving": 0.0, "regime_window": 0}
    # The handshake's CRC covers the guard: workers with other guards disagree.
    a = gf_tf.ChunkSparsity(density=AutoDensity()).reducer().settings()
    b = gf_tf.ChunkSparsity(density=AutoDensity(regime_change=0.5)).reducer().settings()
    assert a[1][1] != b[1][1]


def test_a_rung_sends_at_least_min_chunks_of_each_pack_and_a_fixed_density_warns(caplog):
    """min_chunks raises a rung's k (all of a pack with fewer chunks); the warning names
    density="auto" when a fixed density sends fewer than MIN_CHUNKS of a pack."""
    from gf_tf.csc import selected_chunk_count
    assert [selected_chunk_count(c, 0.01, 8) for c in (0, 3, 8, 100, 1000)] == [0, 3, 8, 8, 10]
    run = Runner(2, gf_tf.ChunkSparsity(density=0.02, chunk_size=CS), compression=None)
    with caplog.at_level("WARNING", logger="gf_tf.csc.reducer"):
        run([[np.ones(N, np.float32)]] * 2)
    (record,) = [r for r in caplog.records if "density=\"auto\"" in r.getMessage()]   # once
    assert "sends 2 of a pack's 100 chunks per step, fewer than 8" in record.getMessage()
    caplog.clear()
    run = Runner(2, gf_tf.ChunkSparsity(density=0.08, chunk_size=CS), compression=None)
    with caplog.at_level("WARNING", logger="gf_tf.csc.reducer"):
        run([[np.ones(N, np.float32)]] * 2)
    assert not [r for r in caplog.records if "auto" in r.getMessage()]


# --- in the traced step --------------------------------------------------------------------

N, CS, C = 400, 4, 100


def _ks(run, grads_per_step):
    """Runs the steps; returns per step the chunks sent, and checks every step's output
    against the float64 CSC reference at that density (replica 0 = replica 1)."""
    model, ks, before = NumpyCSC(N, 2, CS), [], run.gfar.stats.totals()
    for grads in grads_per_step:
        out = run([[g] for g in grads])
        now = run.gfar.stats.totals()
        k = int(now["selected_chunks"] - before["selected_chunks"])
        before = now
        ref, idx = model.step(np.array(grads, np.float64), k / C)
        assert (C if idx is None else len(idx)) == k
        np.testing.assert_array_equal(out[1][0], out[0][0])
        np.testing.assert_allclose(out[0][0], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        ks.append(k)
    return ks


def _grads(rng, scales):
    """Per step, 2 replicas' gradients whose L1 norms differ by replica (0.5x and 1.5x of
    the step's scale): the rule must decide on their sum."""
    chunk_scale = rng.permutation(np.repeat(np.linspace(0.1, 10.0, C), CS))
    return [[(f * s * chunk_scale * rng.uniform(0.9, 1.1, N)).astype(np.float32)
             for f in (0.5, 1.5)] for s in scales]


def test_dense_while_critical_then_the_priced_rung_then_dense_after_a_jump():
    """A slow link (10 s of communication per 1 s of compute): the price says the floor, whose
    k is min_chunks = 8 of the 100 chunks (0.001 x 100 rounds up to 1).
    regime_window=2: steps 0-3 dense (no two windows compared yet: steps 0-1 have no previous
    mean, steps 2-3 compare with it, equal -> calm from step 3 on); sparse (k=8) until the
    gradient's scale jumps 3x at step 8, whose window (steps 8-9) ends critical at step 9:
    dense at 9-11, calm again from step 11 (windows 10-11 and 8-9 agree)."""
    csc = gf_tf.ChunkSparsity(density=AutoDensity(min_density=0.001, regime_window=2),
                              chunk_size=CS)
    run = Runner(2, csc, compression=None)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[10.0, 10.0])
    rng = np.random.default_rng(3)
    ks = _ks(run, _grads(rng, [1.0] * 8 + [3.0] * 6))
    assert ks == [C, C, C, 8, 8, 8, 8, 8, 8, C, C, 8, 8, 8]


def test_a_gradient_whose_bytes_cost_little_is_never_compressed():
    """A fast link (0.2 s of communication per 1 s of compute) at the price's floor (budget
    0.001): compressing could save at most 17% of the step, less than min_saving (25%), so
    every step is dense after the regime has calmed down."""
    csc = gf_tf.ChunkSparsity(density=AutoDensity(budget=0.001, regime_window=2), chunk_size=CS)
    run = Runner(2, csc, compression=None)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[0.2, 0.2])
    ks = _ks(run, _grads(np.random.default_rng(4), [1.0] * 8))
    assert ks == [C] * 8
    assert run.gfar.stats.result()["density"] == 1.0


class _Restoring:
    """Makes the next state a runner creates start from `arrays` (a checkpoint's, as
    gf_tf.keras.checkpoint restores it: when the state is created, before its first step)."""

    def __init__(self, run, arrays):
        self.arrays = arrays
        run.restoring = self   # held by the runner: the registry holds its listeners weakly
        run.gfar.state_registry.add_listener(self.restore)

    def restore(self, variable_set):
        variable_set.assign_arrays(self.arrays)


def test_state_carried_from_fixed_to_auto_and_back_continues_the_float64_model():
    """Residuals and velocities of 3 steps at a fixed density 0.1 go into an "auto" run (the
    regime starts critical: its steps 0-3 dense, whose first flushes the carried residual; then
    the floor, 8 chunks) and from there into a run at 0.25: every step of the three runs
    matches one float64 CSC model with momentum that never restarted."""
    rng = np.random.default_rng(5)
    model = NumpyCSC(N, 2, CS, momentum=0.5)

    def steps(run, scales):
        ks = []
        for grads in _grads(rng, scales):
            before = run.gfar.stats.totals()["selected_chunks"]
            out = run([[g] for g in grads])
            k = int(run.gfar.stats.totals()["selected_chunks"] - before)
            ref, idx = model.step(np.array(grads, np.float64), k / C)
            assert (C if idx is None else len(idx)) == k
            np.testing.assert_array_equal(out[1][0], out[0][0])
            np.testing.assert_allclose(out[0][0], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
            ks.append(k)
        np.testing.assert_allclose(np.stack(run.residuals()), model.residual, rtol=1e-6, atol=1e-6)
        (variable_set,) = run.gfar.states().values()
        return ks, variable_set.to_arrays()

    fixed = Runner(2, gf_tf.ChunkSparsity(density=0.1, chunk_size=CS, momentum=0.5),
                   compression=None)
    ks, arrays = steps(fixed, [1.0] * 3)
    assert ks == [10] * 3 and np.any(arrays["p0_residual_r0"])

    auto = Runner(2, gf_tf.ChunkSparsity(density=AutoDensity(min_density=0.001, regime_window=2),
                                         chunk_size=CS, momentum=0.5), compression=None)
    auto.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[10.0, 10.0])
    _Restoring(auto, arrays)
    ks, arrays = steps(auto, [1.0] * 6)
    assert ks == [C, C, C, 8, 8, 8] and REGIME_KEY in arrays

    back = Runner(2, gf_tf.ChunkSparsity(density=0.25, chunk_size=CS, momentum=0.5),
                  compression=None)
    _Restoring(back, arrays)
    ks, _ = steps(back, [1.0] * 3)
    assert ks == [25] * 3


def _regime(gfar):
    (variable_set,) = gfar.states().values()
    return variable_set.shared.auto.regime.numpy()


def _keras(density):
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=8)
    gfar = gf_tf.GradientFlowAllReduce(sparsity=csc,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    gfar.reducer.clock = FakeClock([1.0, 1.0], [10.0, 10.0])
    return small_keras_model(gfar)


def test_the_regime_is_saved_and_restored_and_checkpoints_cross_density_rules(tmp_path):
    """The regime (float64 [4]) goes into the checkpoint with the residuals: a run restored
    after 2 epochs continues bit for bit as the uninterrupted one (regime and weights). A
    checkpoint of density="auto" restores into a fixed density (the regime is left out) and
    one of a fixed density into "auto" (the regime starts critical: dense steps)."""
    x, y = regression_data()
    rule = lambda: AutoDensity(min_density=0.001, regime_window=2)
    gfar, model = _keras(rule())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    auto_path = str(tmp_path / "auto.weights.h5")
    model.save_weights(auto_path)
    assert _regime(gfar)[2] > 0.0   # windows were measured
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    gfar2, model2 = _keras(rule())
    model2.optimizer.build(model2.trainable_variables)
    model2.load_weights(auto_path)
    model2.fit(x, y, batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(_regime(gfar2), _regime(gfar))
    for a, b in zip(model2.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)

    _, model3 = _keras(0.05)   # auto -> fixed
    model3.optimizer.build(model3.trainable_variables)
    model3.load_weights(auto_path)
    model3.fit(x, y, batch_size=16, epochs=1, verbose=0)
    fixed_path = str(tmp_path / "fixed.weights.h5")
    model3.save_weights(fixed_path)

    gfar4, model4 = _keras(rule())   # fixed -> auto
    model4.optimizer.build(model4.trainable_variables)
    model4.load_weights(fixed_path)
    history = model4.fit(x, y, batch_size=16, epochs=1, verbose=0,
                         callbacks=[gf_tf.GradientFlowStats(gfar4)])
    # Critical again: steps 0-2 dense, step 3 (its window agrees with steps 0-1) at the floor.
    assert history.history["gf_density"] == [pytest.approx((3 * 1.0 + 0.001) / 4)]
    assert _regime(gfar4)[2] > 0.0 and REGIME_KEY == "auto_regime"
