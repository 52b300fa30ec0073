"""gf_tf.ChunkSparsity(density="auto"): the rule, its inputs (all-reduced timing figures), its wire.

The decision is tested with an injected clock (CSCReducer.clock) that feeds
known compute and communication seconds per replica; everything else is real:
MirroredStrategy over 2 logical CPUs, the traced step, the control
all-reduce, the chunk all-reduce, a NumPy float64 CSC reference.
Across 2 worker processes: test_sparsity_multiworker.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import math

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.csc import AUTO_LADDER, AutoDensity, choose_rung
from csc_reference import NumpyCSC, NumpyGlobalCSC
from helpers import Runner, all_ops, only_state, pack_states, small_keras_model, three_pack_step


class FakeClock:
    """CSCReducer.clock for tests: replica r's clock advances by compute[r] seconds up to
    "ready", not at all up to "send" and by comm[r] seconds up to "done", so it measures
    exactly those figures."""

    def __init__(self, compute, comm):
        self.compute, self.comm = compute, comm
        with tf.device("/cpu:0"):
            self.now = [tf.Variable(100.0, dtype=tf.float64, trainable=False) for _ in compute]

    def __call__(self, replica, event):
        step = {"ready": self.compute, "send": [0.0] * len(self.comm), "done": self.comm}[event][replica]
        return self.now[replica].assign_add(step)


def priced(min_density=0.01, budget=0.05):
    """density="auto"'s price rule alone (`choose_rung`): no critical-regime test, no minimum
    saving or chunk count, so every step after the warm-up takes the rung its timing prices."""
    return AutoDensity(min_density, budget, min_saving=0.0, regime_window=0, min_chunks=1)


# --- arguments, rungs, schedule ---------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(density="fast"), "density"), (dict(density="AUTO"), "density"),
    (dict(density=True), "density"),
    (dict(density="auto", min_density=0.0), "min_density"),
    (dict(density="auto", min_density=1.5), "min_density"),
    (dict(density="auto", min_density="0.01"), "min_density"),
    (dict(density="auto", auto_budget=0.0), "auto_budget"),
    (dict(density="auto", auto_budget=-1.0), "auto_budget"),
    (dict(density="auto", auto_budget=math.inf), "auto_budget"),
])
def test_bad_auto_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gf_tf.ChunkSparsity(**kwargs)


def test_rungs_are_the_ladder_above_the_floor_then_the_floor():
    assert AUTO_LADDER == (1.0, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001)
    # The default floor is DEFAULT_DENSITY (0.01): the ladder's rungs below it are left out.
    assert gf_tf.ChunkSparsity(density="auto").rungs() == (1.0, 0.25, 0.1, 0.03, 0.01)
    assert gf_tf.ChunkSparsity(density="auto", min_density=0.001).rungs() == AUTO_LADDER
    assert gf_tf.ChunkSparsity(density="auto", min_density=0.01).rungs() == \
        (1.0, 0.25, 0.1, 0.03, 0.01)
    assert gf_tf.ChunkSparsity(density="auto", min_density=0.005).rungs() == \
        (1.0, 0.25, 0.1, 0.03, 0.01, 0.005)
    assert gf_tf.ChunkSparsity(density="auto", min_density=1.0).rungs() == (1.0,)
    assert gf_tf.ChunkSparsity(density=0.02).rungs() == (0.02,)


def test_config_and_repr_carry_the_auto_settings_and_numeric_ones_are_unchanged():
    auto = gf_tf.ChunkSparsity(density="auto", min_density=0.01, auto_budget=0.1, chunk_size=64)
    assert auto.get_config() == {"density": "auto", "chunk_size": 64, "warmup_steps": 0,
                                 "momentum": 0.0, "warmup": "dense", "selection": "per_pack",
                                 "min_density": 0.01, "auto_budget": 0.1}
    assert gf_tf.ChunkSparsity(**auto.get_config()).get_config() == auto.get_config()
    assert "density='auto'" in repr(auto) and "min_density=0.01" in repr(auto) \
        and "auto_budget=0.1" in repr(auto)
    assert gf_tf.ChunkSparsity(density=0.01).get_config() == {
        "density": 0.01, "chunk_size": 1024, "warmup_steps": 0, "momentum": 0.0, "warmup": "dense",
        "selection": "per_pack"}
    assert repr(gf_tf.ChunkSparsity(density=0.01)) == (
        "ChunkSparsity(density=0.01, chunk_size=1024, warmup_steps=0, momentum=0.0, "
        "warmup='dense', selection='per_pack')")


def test_auto_schedules_keep_the_warmup_and_end_in_auto():
    dense = gf_tf.ChunkSparsity(density="auto", warmup_steps=50)
    assert dense.schedule() == ((0, 1.0), (50, "auto"))
    assert [dense.density_at(s) for s in (0, 49, 50)] == [1.0, 1.0, "auto"]
    expo = gf_tf.ChunkSparsity(density="auto", min_density=0.01, warmup_steps=30,
                               warmup="exponential")
    assert expo.schedule() == ((0, 0.25), (10, 0.0625), (20, 0.015625), (30, "auto"))
    assert gf_tf.ChunkSparsity(density="auto").schedule() == ((0, "auto"),)


def test_the_default_is_auto_with_a_floor_of_one_percent():
    auto = gf_tf.ChunkSparsity()
    assert auto.density == gf_tf.csc.DEFAULT_DENSITY == "auto" and auto.auto
    assert auto.min_density == gf_tf.csc.DEFAULT_MIN_DENSITY == 0.01
    assert auto.rungs()[-1] == 0.01
    assert auto.get_config()["min_density"] == 0.01 and "min_density=0.01" in repr(auto)
    # A dense warm-up still ramps to the floor with the exponential schedule: 25%, 6.25%,
    # 1.5625% (above 1%), then auto.
    expo = gf_tf.ChunkSparsity(density="auto", warmup_steps=30, warmup="exponential")
    assert expo.schedule() == ((0, 0.25), (10, 0.0625), (20, 0.015625), (30, "auto"))


# --- the rule ---------------------------------------------------------------------

# Bytes of 4 rungs and budget x compute = 0.5 x 1.0 = 0.5 s: exact binary fractions, so each
# case below is decided by exact float32 arithmetic.
RUNG_BYTES = (1024.0, 512.0, 256.0, 128.0)


@pytest.mark.parametrize("comm_seconds, expected", [
    (0.25, 0),    # predicted 0.25 s at rung 0 (measured at 1024 bytes): fits
    (0.5, 0),     # 0.5 s == the budget: a tie fits
    (1.0, 1),     # 1.0, 0.5 (tie), ...
    (1.5, 2),     # 1.5, 0.75, 0.375
    (4.0, 3),     # 4, 2, 1, 0.5 (tie)
    (8.0, 3),     # nothing fits: the floor
])
def test_rule_picks_the_largest_rung_whose_predicted_communication_fits(comm_seconds, expected):
    rung = choose_rung(1.0, comm_seconds, 1024.0, RUNG_BYTES, budget=0.5)
    assert rung.dtype == tf.int32 and int(rung) == expected


def test_rule_scales_the_measured_time_by_bytes():
    # Measured 0.25 s at 128 bytes: 2 s at 1024, 1 s at 512, 0.5 s at 256 (tie: fits).
    assert int(choose_rung(1.0, 0.25, 128.0, RUNG_BYTES, budget=0.5)) == 2
    # Twice the compute time doubles the budget: 1 s at 512 fits.
    assert int(choose_rung(2.0, 0.25, 128.0, RUNG_BYTES, budget=0.5)) == 1


@pytest.mark.parametrize("figures", [
    (0.0, 0.0, 0.0),                 # nothing measured yet (the first step)
    (1.0, 0.25, 0.0), (0.0, 0.25, 1024.0), (1.0, 0.0, 1024.0),
    (np.nan, 0.25, 1024.0), (np.inf, 0.25, 1024.0), (1.0, -0.25, 1024.0),
])
def test_rule_falls_to_the_floor_without_a_valid_measurement(figures):
    assert int(choose_rung(*figures, RUNG_BYTES, budget=0.5)) == 3


@pytest.mark.parametrize("latency_bytes, expected", [
    (0.0, 3),       # 1.0 s measured at 128 B: 8, 4, 2, 1 s; only the floor (nothing fits)
    (384.0, 2),     # 1.0 s over 128 + 384 B: 2, 1, 0.5 (tie: fits) s
    (896.0, 1),     # over 1024 B: 1, 0.5 (tie) s
    (1920.0, 0),    # over 2048 B: 0.5 s (tie) at 1024 B
])
def test_rule_leaves_the_links_latency_bytes_out_of_a_rungs_price(latency_bytes, expected):
    """A latency-bound measurement: 1 s at 128 bytes, mostly fixed cost. Priced over
    128 + latency_bytes, denser rungs fit the 0.5 s budget."""
    rung = choose_rung(1.0, 1.0, 128.0, RUNG_BYTES, budget=0.5, latency_bytes=latency_bytes)
    assert int(rung) == expected


def test_rule_with_equal_rung_bytes_picks_the_first_of_them():
    # Small packs: several densities give the same k, hence the same bytes.
    assert int(choose_rung(1.0, 0.5, 512.0, (512.0, 512.0, 256.0), budget=0.5)) == 0
    assert int(choose_rung(1.0, 0.5, 256.0, (512.0, 512.0, 256.0), budget=0.5)) == 2


# --- in the traced step, from all-reduced figures -----------------------------------

# One pack of 400 float32 elements in chunks of 4: 100 chunks. Rungs 0.25 .. 0.001 send
# k = 25, 10, 3, 1, 1, 1 chunks; a step puts 4 x 4 (timing) + 4 x 100 (norms) + 16 k bytes
# (float32 wire) into the collectives: 816, 576, 464, 432 bytes.
N, CS, C = 400, 4, 100


def _bytes(k):
    return 16 + 4 * C + 4 * CS * k


def test_replicas_with_different_figures_pick_the_rung_of_the_mean_and_match_numpy():
    """Replica 0 measures 0.05 s of communication, replica 1 0.35 s (1 s compute each,
    budget 0.25 s). Alone, replica 0 would pick 25 chunks and replica 1 the floor; from the
    all-reduced figures (mean 0.2 s) both pick the same rung, step by step:
      step 0: nothing measured -> floor (k=1, 432 bytes)
      step 1: 0.2 s at 432 B -> 25: 0.378 s, 10: 0.267 s, 3: 0.215 s fits -> k=3
      step 2: 0.2 s at 464 B -> 25: 0.352 s, 10: 0.248 s fits -> k=10
      step 3: 0.2 s at 576 B -> 25: 0.283 s, 10: 0.2 s fits -> k=10
    and the reduced gradients equal a float64 CSC reference at that k."""
    csc = gf_tf.ChunkSparsity(density=priced(0.001, 0.25), chunk_size=CS)
    run = Runner(2, csc, compression=None)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[0.05, 0.35])
    model = NumpyCSC(N, 2, CS)
    rng = np.random.default_rng(11)
    ks, before = [], run.gfar.stats.totals()
    for _ in range(4):
        scale = rng.permutation(np.repeat(np.linspace(0.1, 10.0, C), CS))  # no near ties
        grads = [rng.normal(size=N).astype(np.float32) * scale.astype(np.float32)
                 for _ in range(2)]
        out = run([[g] for g in grads])
        now = run.gfar.stats.totals()
        k = int(now["selected_chunks"] - before["selected_chunks"])
        assert now["sent_bytes"] - before["sent_bytes"] == _bytes(k)
        ks.append(k)
        before = now
        ref, idx = model.step(np.array(grads, np.float64), k / C)
        assert len(idx) == k
        np.testing.assert_array_equal(out[1][0], out[0][0])
        np.testing.assert_allclose(out[0][0], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        for r, residual in enumerate(run.residuals()):
            np.testing.assert_allclose(residual, model.residual[r], rtol=1e-6, atol=1e-5)
    assert ks == [1, 3, 10, 10]
    stats = run.gfar.stats.result()
    assert stats["density"] == pytest.approx((0.001 + 0.03 + 0.1 + 0.1) / 4)
    (variable_set,) = run.gfar.states().values()
    assert [float(v.numpy()) for v in variable_set.shared.auto.sent] == [_bytes(10)] * 2


def test_first_sparse_step_after_a_dense_warmup_uses_the_warmup_measurement():
    """2 dense warm-up steps (all 100 chunks: 416 + 1600 = 2016 bytes) measure 0.5 s of
    communication per 1 s of compute; at budget 0.05 the prediction for the floor,
    0.5 x 432 / 2016 = 0.107 s, does not fit: floor. At budget 0.25: 25 chunks,
    0.5 x 816 / 2016 = 0.202 s, fits (dense, 0.5 s, does not). At budget 0.5 the dense rung,
    0.5 s, fits (a tie)."""
    for budget, sparse_k, density in ((0.05, 1, 0.001), (0.25, 25, 0.25), (0.5, C, 1.0)):
        csc = gf_tf.ChunkSparsity(density=priced(0.001, budget), chunk_size=CS, warmup_steps=2)
        run = Runner(2, csc, compression=None)
        run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[0.5, 0.5])
        ks, before = [], run.gfar.stats.totals()
        for _ in range(3):
            run([[np.linspace(1, 2, N).astype(np.float32)]] * 2)
            now = run.gfar.stats.totals()
            ks.append(int(now["selected_chunks"] - before["selected_chunks"]))
            before = now
        assert ks == [C, C, sparse_k], budget
        assert run.gfar.stats.result()["density"] == pytest.approx((2 * 1.0 + density) / 3)


def test_a_latency_bound_link_keeps_the_dense_rung(monkeypatch):
    """As the test above at budget 0.05 (the floor from bytes alone), with the link's
    latency worth 38,228 bytes (the planner's `latency_bytes`, injected here): the dense
    steps' 0.5 s is priced 0.5 x 2016 / 40244 = 0.025 s <= 0.05 s, so every step
    stays dense, and the reduced gradient is the replicas' sum (float64 reference)."""
    monkeypatch.setattr(gf_tf.plan, "latency_bytes", lambda algorithm, workers, costs: 38228.0)
    csc = gf_tf.ChunkSparsity(density=priced(0.001, 0.05), chunk_size=CS, warmup_steps=2)
    run = Runner(2, csc, compression=None)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[0.5, 0.5])
    rng = np.random.default_rng(5)
    ks, before = [], run.gfar.stats.totals()
    for _ in range(4):
        grads = [rng.normal(size=N).astype(np.float32) for _ in range(2)]
        out = run([[g] for g in grads])
        now = run.gfar.stats.totals()
        ks.append(int(now["selected_chunks"] - before["selected_chunks"]))
        before = now
        np.testing.assert_allclose(out[0][0], grads[0].astype(np.float64) + grads[1],
                                   rtol=1e-6, atol=1e-7)
    assert ks == [C] * 4
    assert run.gfar.stats.result()["density"] == 1.0


@pytest.mark.parametrize("min_density, k, visit_steps", [
    (None, 3, 84),     # the default floor 0.01: k = ceil(2.5) = 3, ceil(250 / 3) = 84 <= 100
    (0.03, 8, 32),     # k = ceil(7.5) = 8, ceil(250 / 8) = 32 <= 1 / 0.03
])
def test_at_the_floor_every_chunk_is_sent_within_one_over_min_density_steps(
        min_density, k, visit_steps):
    """1000 float32 elements in 250 chunks of 4, every element's gradient 1 on both replicas;
    10 s of communication per 1 s of compute: nothing fits, every step takes the floor.
    Error feedback then sends the chunks in turn (ties to the lower index): chunk i first at
    step i // k, carrying 2 x (step + 1) per element (2 replicas' residuals), so all 250
    have been sent after ceil(250 / k) steps and not one step earlier."""
    n = 1000
    kwargs = {} if min_density is None else {"min_density": min_density}
    csc = gf_tf.ChunkSparsity(density=priced(**kwargs), chunk_size=CS)
    floor = csc.rungs()[-1]
    run = Runner(2, csc, compression=None)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[10.0, 10.0])
    model = NumpyCSC(n, 2, CS)
    ones = np.ones(n, np.float32)
    first_sent = np.full(250, -1)
    for step in range(visit_steps):
        out = run([[ones], [ones]])
        ref, idx = model.step(np.array([ones, ones], np.float64), floor)
        assert len(idx) == k
        np.testing.assert_array_equal(out[0][0], ref)
        sent = np.flatnonzero(out[0][0].reshape(250, CS).any(axis=1))
        np.testing.assert_array_equal(sent, idx)
        new = sent[first_sent[sent] < 0]
        np.testing.assert_array_equal(out[0][0].reshape(250, CS)[new], 2.0 * (step + 1))
        first_sent[new] = step
        if step == visit_steps - 2:
            assert np.sum(first_sent < 0) > 0
    np.testing.assert_array_equal(first_sent, np.arange(250) // k)
    assert visit_steps <= 1 / floor
    assert run.gfar.stats.result()["density"] == pytest.approx(floor)


def test_auto_travels_in_two_collectives_per_step():
    """Three packs (as test_several_packs_travel_in_two_collectives_per_step): the timing
    figures join the chunk norms in the one float32 control all-reduce; each rung's branch
    holds exactly one chunk all-reduce, and one branch runs per step."""
    sizes = [12, 8, 20]     # 3, 2, 5 chunks of 4: k = (1, 1, 2) at 0.25, (1, 1, 1) below
    gfar, strategy, step = three_pack_step(
        gf_tf.ChunkSparsity(density=priced(budget=0.75), chunk_size=4), sizes,
        clock=FakeClock(compute=[1.0, 1.0], comm=[0.5, 0.5]))

    rng = np.random.default_rng(5)
    refs = [NumpyCSC(n, 2, 4) for n in sizes]
    # Step 0: the floor; then 0.5 s measured per 1 s of compute fits the 0.25 rung
    # (0.5 x 120 / 104 bytes = 0.58 s <= 0.75 s) and not the dense one (0.5 x 216 / 120 bytes).
    for ks in [(1, 1, 1), (1, 1, 2), (1, 1, 2)]:
        grads = [rng.normal(size=(2, n)).astype(np.float32) for n in sizes]
        values = [strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: tf.constant(g[ctx.replica_id_in_sync_group])) for g in grads]
        out = step(*values)
        for j, (ref, g, k) in enumerate(zip(refs, grads, ks)):
            want, idx = ref.step(g, k / ref.c)
            assert len(idx) == k
            for o in strategy.experimental_local_results(out[j]):
                np.testing.assert_allclose(o.numpy(), want, rtol=1e-6, atol=1e-6)
    graph = step.get_concrete_function(*values).graph
    main = _vector_sums(graph.get_operations())
    assert main == [("float32", 4 + 3 + 2 + 5)], main     # timing + norms, outside the branches
    cases = [op for op in all_ops(graph) if op.type in ("Case", "StatelessCase")]
    assert len(cases) == 1
    branch_sums = [_vector_sums(graph._get_function(fn.name).graph.get_operations())  # pylint: disable=protected-access
                   for fn in cases[0].get_attr("branches")]
    assert sorted(branch_sums) == [[("float32", 12)], [("float32", 16)], [("float32", 40)]], \
        branch_sums
    assert gfar.stats.totals()["selected_chunks"] == 3 + 4 + 4


def _vector_sums(operations):
    return sorted((op.get_attr("T").name, op.outputs[0].shape.num_elements())
                  for op in operations if op.type == "AddN"
                  and op.outputs[0].shape.num_elements() not in (None, 1))


def test_settings_handshake_names_auto():
    from gf_tf import route
    from gf_tf.plan import Forecast, Plan, Planned
    from gf_tf.reducers import MAX_REDUCER_SETTINGS, DenseReducer

    def density(reducer):
        ((_, code, show),) = [s for s in reducer.settings() if s[0] == "sparsity density"]
        return code, show(code)
    assert density(gf_tf.ChunkSparsity(density="auto").reducer())[1] == "auto"
    assert density(gf_tf.ChunkSparsity(density=0.01).reducer())[1] == "0.01"
    # The dense reducer declares no settings: in the handshake its columns, where CSC's
    # density and settings CRC32 go, are the padding's zeros.
    assert DenseReducer().settings() == []

    def reducer_columns(reducer):
        planned = Planned(Plan("fp16", 0, "ring"), Forecast())
        return [number for _, number, _ in route.settings((), planned, reducer)[-MAX_REDUCER_SETTINGS:]]
    assert reducer_columns(DenseReducer()) == [0.0] * MAX_REDUCER_SETTINGS
    assert reducer_columns(gf_tf.ChunkSparsity(density="auto").reducer())[0] == -1.0


def _keras_auto(clock):
    csc = gf_tf.ChunkSparsity(density=priced(0.001, 1.0), chunk_size=8, warmup_steps=2)
    gfar = gf_tf.GradientFlowAllReduce(sparsity=csc,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    gfar.reducer.clock = clock
    return small_keras_model(gfar)


def test_fit_save_and_restore_with_auto(tmp_path):
    """195 parameters, 25 chunks of 8, float16 wire; 2 dense steps (506 bytes) measure 0.5 s
    per 1 s of compute, so at budget 1 s the dense rung (0.5 s) fits and every step stays
    dense. The timing state is not checkpointed: after load_weights the step counter goes on
    (no second warm-up) and the first step, unmeasured, takes the floor (k=1); from its 0.5 s
    the 0.25 rung (k=7, 228 bytes) fits and dense (0.5 x 506 / 228 s) does not."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).astype(np.float32)
    gfar, model = _keras_auto(FakeClock([1.0, 1.0], [0.5, 0.5]))
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                        callbacks=[gf_tf.GradientFlowStats(gfar)])
    assert history.history["gf_selected_chunks_per_step"] == [25]
    assert history.history["gf_density"] == [1.0]
    path = str(tmp_path / "auto.weights.h5")
    model.save_weights(path)

    gfar2, model2 = _keras_auto(FakeClock([1.0, 1.0], [0.5, 0.5]))
    model2.optimizer.build(model2.trainable_variables)
    model2.load_weights(path)
    history = model2.fit(x, y, batch_size=16, epochs=1, verbose=0,
                         callbacks=[gf_tf.GradientFlowStats(gfar2)])
    assert history.history["gf_selected_chunks_per_step"] == [(1 + 7 + 7 + 7) / 4]
    assert history.history["gf_density"] == [pytest.approx((0.001 + 3 * 0.25) / 4)]
    assert int(only_state(gfar2).step.numpy()) == 8
    assert np.all(np.isfinite(history.history["loss"]))


def test_auto_with_global_selection_prices_rungs_by_one_top_k_over_all_packs():
    """density="auto" and selection="global" together: packs of 400 and 200 elements (chunk 4:
    100 + 50 = 150 chunks), float32 wire. A rung sends K = ceil(d x 150) chunks in all, so
    its bytes are 16 + 4 x 150 + 16 K: floor 632 B (K=1), 0.01: 640 B (K=2), 0.03: 696 B
    (K=5), 0.1: 856 B (K=15), 0.25: 1224 B (K=38). 1 s of compute, 0.2 s of communication,
    budget 0.25 s:
      step 0: nothing measured -> floor, K=1
      step 1: 0.2 s at 632 B -> 0.1: 0.271 s, 0.03: 0.220 s fits -> K=5
      step 2: 0.2 s at 696 B -> 0.25: 0.352 s, 0.1: 0.246 s fits -> K=15
      step 3: 0.2 s at 856 B -> 0.25: 0.286 s, 0.1: 0.2 s fits -> K=15
    and the outputs equal the float64 global-selection reference at that density."""
    sizes = [400, 200]
    csc = gf_tf.ChunkSparsity(density=priced(0.001, 0.25), chunk_size=CS, selection="global")
    run = Runner(2, csc, compression=None, bytes_per_pack=1)
    run.gfar.reducer.clock = FakeClock(compute=[1.0, 1.0], comm=[0.2, 0.2])
    rng = np.random.default_rng(5)
    model, order, ks, before = None, None, [], run.gfar.stats.totals()
    for _ in range(4):
        flat = rng.permutation(np.linspace(0.1, 10.0, 150))   # one scale per chunk: no near ties
        scales = [flat[:100], flat[100:]]
        grads = [[(rng.uniform(0.5, 1.5, n) * np.repeat(sc, CS)).astype(np.float32)
                  for n, sc in zip(sizes, scales)] for _ in range(2)]
        out = run(grads)
        if model is None:
            order, _ = pack_states(run)
            model = NumpyGlobalCSC([sizes[i] for i in order], 2, CS)
        now = run.gfar.stats.totals()
        k = int(now["selected_chunks"] - before["selected_chunks"])
        assert now["sent_bytes"] - before["sent_bytes"] == 16 + 4 * 150 + 4 * CS * k
        ks.append(k)
        before = now
        density = {1: 0.001, 2: 0.01, 5: 0.03, 15: 0.1, 38: 0.25}[k]
        refs, shares = model.step([np.stack([g[i] for g in grads]).astype(np.float64)
                                   for i in order], density)
        assert sum(len(s) for s in shares) == k
        for ref, i in zip(refs, order):
            np.testing.assert_array_equal(out[1][i], out[0][i])
            np.testing.assert_allclose(out[0][i], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert ks == [1, 5, 15, 15]
