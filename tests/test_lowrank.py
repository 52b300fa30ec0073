"""gf_tf.reducers.LowRank (PowerSGD) against a float64 NumPy model of the method
(lowrank_reference.Model): power iteration with a warm-started Q, Gram-Schmidt, error feedback;
the dense path of small tensors; its settings' errors; non-finite steps; its state through
BackupAndRestore; bitwise equal results on 2 and 3 real workers.

In-process: MirroredStrategy over logical CPUs (tests/conftest.py), ReductionToOneDevice.
"""

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf import reducers, wire
from gf_tf.reducers import LowRank
from gf_tf.reducers.lowrank import matrix_shape
from gf_tf.state import VariableSetState
from helpers import DEVICES
from lowrank_reference import Model
from test_reducer_checkpoint import preempted_and_resumed

# Two compressed matrices (a dense kernel and a conv kernel, [36, 6]) at rank 2; a bias and a
# small kernel ((4 + 3) 2 > 4 3 / 2) travel dense.
SHAPES = [(12, 10), (3, 3, 4, 6), (10,), (4, 3)]
STEPS = 20


class Harness:
    """One traced all-reduce of one gradient per variable of `shapes` on `replicas` replicas."""

    def __init__(self, replicas, reducer, compression, shapes=SHAPES):
        self.replicas, self.shapes = replicas, shapes
        self.gfar = gf_tf.GradientFlowAllReduce(
            compression=compression, reducer=reducer, algorithm="ring",
            cross_device_ops=tf.distribute.ReductionToOneDevice())
        self.strategy = tf.distribute.MirroredStrategy(DEVICES[:replicas], cross_device_ops=self.gfar)
        self.variables = [tf.Variable(np.zeros(s, np.float32)) for s in shapes]

        @tf.function
        def step(*per_replica):
            def fn(*grads):
                return gf_tf.all_reduce_gradients([tf.identity(g) for g in grads], self.variables)
            return self.strategy.run(fn, args=per_replica)
        self._step = step

    def __call__(self, grads):
        """grads[r][i]: replica r's gradient of variable i -> per replica the reduced arrays."""
        inputs = [self.strategy.experimental_distribute_values_from_function(
            lambda ctx, i=i: tf.constant(grads[ctx.replica_id_in_sync_group][i]))
            for i in range(len(self.shapes))]
        out = self._step(*inputs)
        return [[self.strategy.experimental_local_results(o)[r].numpy() for o in out]
                for r in range(self.replicas)]

    def spec_and_state(self):
        (variable_set,) = self.gfar.states().values()
        (spec,) = variable_set.pack_specs
        (state,) = variable_set.pack_states
        return spec, state

    def step_count(self):
        """The alternating form's step counter (local replica 0's; every replica's equal)."""
        (variable_set,) = self.gfar.states().values()
        counts = {int(v.numpy()) for v in variable_set.shared.steps}
        assert len(counts) == 1, counts
        return counts.pop()


def gradients(rng, replicas, shapes=SHAPES, scale=1.0):
    return [[(scale * rng.normal(size=s)).astype(np.float32) for s in shapes]
            for _ in range(replicas)]


def assert_close(got, want, rtol):
    """Elementwise within rtol of the tensor's largest magnitude (near-zero entries of a
    low-rank product have no relative precision of their own)."""
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("compression, rtol, scale", [(None, 1e-6, 1.0), ("fp16", 1e-3, 1e4)])
def test_each_of_20_steps_matches_the_float64_model(replicas, compression, rtol, scale):
    """Step by step from the state the reducer holds (Q and residuals read before the step):
    the outputs and the new state match the float64 model of one step. (Left to run on its own
    the model drifts from any float32 run: with random full-rank gradients the residuals grow and
    each power step amplifies the previous steps' rounding, 1e-7 at step 1 to 1e-4 at step 20.)
    On the FP16 wire the gradients are 1e4 in size: unscaled, the factors' sums would
    overflow float16 (their entries reach about 1e5)."""
    reducer = LowRank(rank=2, warmup_steps=0)
    run = Harness(replicas, reducer, compression)
    rng = np.random.default_rng(replicas)
    model = None
    for t in range(STEPS):
        grads = gradients(rng, replicas, scale=scale)
        if model is not None:
            model.load(state.to_arrays())
        out = run(grads)
        if model is None:   # the state exists from the first step's trace on
            spec, state = run.spec_and_state()
            assert [spec.shapes[p] for p in reducer.layout(spec).matrices] == [(3, 3, 4, 6), (12, 10)]
            model = Model(reducer, spec, replicas, fp16=compression == "fp16")
        want = model.step(grads)
        for r in range(replicas):
            for i, (got, expected) in enumerate(zip(out[r], want)):
                assert np.all(np.isfinite(got))
                assert_close(got, expected, rtol), (t, r, i)
        for r in range(1, replicas):   # every replica gets the same bits
            assert all(a.tobytes() == b.tobytes() for a, b in zip(out[0], out[r]))
        arrays = state.to_arrays()
        for key, value in model.arrays().items():
            assert_close(arrays[key], value, rtol), (t, key)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("compression, rtol, scale", [(None, 1e-6, 1.0), ("fp16", 1e-3, 1e4)])
def test_each_of_20_alternating_steps_matches_the_float64_model(replicas, compression, rtol, scale):
    """The one-collective form (ACP-SGD) as the two-collective test above: from the state the
    reducer holds before each step (Q, P, residuals, step count), the outputs and the new state
    match the float64 model; the count moves by one a step on every replica."""
    reducer = LowRank(rank=2, alternate=True, warmup_steps=0)
    run = Harness(replicas, reducer, compression)
    rng = np.random.default_rng(10 + replicas)
    model = None
    for t in range(STEPS):
        grads = gradients(rng, replicas, scale=scale)
        if model is not None:
            model.load(state.to_arrays(), run.step_count())
        out = run(grads)
        if model is None:
            spec, state = run.spec_and_state()
            model = Model(reducer, spec, replicas, fp16=compression == "fp16")
        want = model.step(grads)
        assert run.step_count() == t + 1
        for r in range(replicas):
            for i, (got, expected) in enumerate(zip(out[r], want)):
                assert np.all(np.isfinite(got))
                assert_close(got, expected, rtol), (t, r, i)
        for r in range(1, replicas):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(out[0], out[r]))
        arrays = state.to_arrays()
        assert sorted(arrays) == sorted(model.arrays())
        for key, value in model.arrays().items():
            assert_close(arrays[key], value, rtol), (t, key)


def test_error_feedback_sends_what_rank_1_left_behind():
    """A rank-2 gradient at rank 1: the first step sends one direction, the residual keeps the
    other, and the sum of what all steps sent approaches the sum of the gradients."""
    shape = (16, 8)
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(16, 2)), rng.normal(size=(8, 2))
    g = (u @ np.diag([3.0, 1.0]) @ v.T).astype(np.float32)
    run = Harness(2, LowRank(rank=1, min_compression=1, warmup_steps=0), None, shapes=[shape])
    total = 2 * g.astype(np.float64)
    sent, missed = np.zeros(shape), []
    for t in range(1, 61):
        sent += run([[g], [g]])[0][0]
        missed.append(np.linalg.norm(sent - t * total) / np.linalg.norm(t * total))
    assert missed[0] > 0.2 and missed[-1] < 0.2 * missed[0], missed


def test_small_tensors_travel_dense_and_exact():
    shapes = [(12, 10), (4, 3), (10,), (2, 2, 2)]
    reducer = LowRank(rank=2, warmup_steps=0)
    run = Harness(2, reducer, None, shapes=shapes)
    grads = gradients(np.random.default_rng(1), 2, shapes)
    out = run(grads)
    for i in range(1, len(shapes)):
        np.testing.assert_array_equal(out[0][i], grads[0][i] + grads[1][i])
    spec, state = run.spec_and_state()
    assert [spec.shapes[p] for p in reducer.layout(spec).matrices] == [(12, 10)]
    assert sorted(state.to_arrays()) == ["q0_r0", "q0_r1", "residual_r0", "residual_r1"]
    assert run.gfar.stats.totals()["figure_compressed_elements"] == 12 * 10


@pytest.mark.parametrize("kwargs, shapes, message", [
    ({"rank": 3}, [(4, 3), (10,)], "rank 3 compresses none of this model's matrices at "
                                   "min_compression 2: its best, 4x3, takes no rank; "
                                   "min_compression must be at most 1.71429 for it"),
    ({"rank": 8}, [(12, 10), (8,)], "rank 8 compresses none of this model's matrices at "
                                    "min_compression 2: its best, 12x10, takes rank 1 to 2"),
])
def test_a_rank_that_compresses_nothing_is_refused_naming_the_ranks_that_would(kwargs, shapes,
                                                                               message):
    signature = [(tf.TensorShape(s), tf.float32) for s in shapes]
    specs = gf_tf.packing.plan_packs(signature, 0, wire.get(None))
    with pytest.raises(ValueError, match=message):
        LowRank(**kwargs).create_states(specs, DEVICES[:2])
    LowRank(**kwargs).create_states(specs[:0], DEVICES[:2])   # no matrices: nothing to refuse


def test_matrix_shape_folds_all_dimensions_but_the_last():
    assert matrix_shape((3, 3, 4, 6)) == (36, 6)
    assert matrix_shape((12, 10)) == (12, 10)
    assert matrix_shape((10,)) is None and matrix_shape(()) is None


def test_figures_count_compressed_and_factor_elements():
    run = Harness(2, LowRank(rank=2, warmup_steps=0), None)
    run(gradients(np.random.default_rng(2), 2))
    totals = run.gfar.stats.totals()
    assert totals["figure_compressed_elements"] == 12 * 10 + 36 * 6
    assert totals["figure_factor_elements"] == (12 + 10) * 2 + (36 + 6) * 2


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "rank must be an integer >= 1, got 0"),
    ({"rank": -1}, "rank must be an integer >= 1, got -1"),
    ({"rank": 2.5}, "rank must be an integer >= 1, got 2.5"),
    ({"rank": True}, "rank must be an integer >= 1, got True"),
    ({"rank": "2"}, "rank must be an integer >= 1, got '2'"),
    ({"min_compression": 0.5}, r"min_compression must be a finite number >= 1 .* got 0.5"),
    ({"min_compression": float("inf")}, r"min_compression must be a finite number >= 1 .* got inf"),
    ({"min_compression": "2"}, r"min_compression must be a finite number >= 1 .* got '2'"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"warmup_steps": -1}, r"warmup_steps must be an integer >= 0 \(dense steps before "
                           r"compression starts\), got -1"),
    ({"warmup_steps": 2.0}, r"warmup_steps must be an integer >= 0 .* got 2.0"),
])
def test_bad_settings_name_the_setting_and_its_accepted_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LowRank(**kwargs)


def test_settings_and_cost():
    reducer = LowRank(rank=4, min_compression=3)
    assert [(name, value) for name, value, _ in reducer.settings()] == [
        ("low-rank rank", 4), ("low-rank min_compression", 3.0), ("low-rank seed", 0),
        ("low-rank warmup_steps", 50)]
    assert reducer.cost(1 << 20, wire.FP16).collective_bytes == (8, 2 * 1024 * 4, 2 * 1024 * 4)
    assert reducer.cost(1 << 20, wire.get(None)).collective_bytes == (4 * 1024 * 4,) * 2
    assert reducer.cost(100, wire.get(None)).collective_bytes == (400,)   # 10 x 10: dense


@pytest.mark.parametrize("bad_variable", [0, 2])   # a compressed matrix; a dense bias
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_step_reaches_the_outputs_and_leaves_the_state(bad_variable, bad):
    run = Harness(2, LowRank(rank=2, warmup_steps=0), "fp16")
    rng = np.random.default_rng(3)
    for _ in range(3):
        run(gradients(rng, 2))
    _, state = run.spec_and_state()
    before = state.to_arrays()
    grads = gradients(rng, 2)
    grads[1][bad_variable].flat[5] = bad
    out = run(grads)
    for r in range(2):
        assert not np.all(np.isfinite(out[r][bad_variable]))
    after = state.to_arrays()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)
    run(gradients(rng, 2))   # the next finite step moves the state again
    assert np.any(state.to_arrays()["residual_r0"] != before["residual_r0"])


def test_backup_and_restore_gives_back_q_and_residuals_bitwise(tmp_path):
    """fit on 2 replicas (both kernels compressed at rank 1, FP16 wire), preempted after epoch 1
    under BackupAndRestore; the restarted job gets Q and the residuals back bit for bit and ends
    with the weights and state of an uninterrupted run."""
    saved, gfar_a, gfar_c = preempted_and_resumed(lambda: LowRank(rank=1, warmup_steps=0),
                                                  tmp_path)
    assert {"p0_q0_r0", "p0_q1_r1", "p0_residual_r0", "p0_residual_r1"} <= set(saved)
    assert np.any(saved["p0_residual_r1"] != saved["p0_residual_r0"])
    assert gfar_c.stats.totals() == gfar_a.stats.totals()


@pytest.mark.parametrize("compression, collectives", [
    (None, ["float32"] * 3),                    # the dense pack, the P's, the Q's
    ("fp16", ["float32"] + ["float16"] * 3),   # the control vector first
])
def test_a_step_issues_one_all_reduce_for_the_ps_and_one_for_the_qs(compression, collectives):
    """The reducer called directly with a Communicator that records each all-reduce (2 replicas
    on one worker): the P's of both matrices travel in one buffer, the Q's in another."""
    reducer = LowRank(rank=2, warmup_steps=0)
    signature = [(tf.TensorShape(s), tf.float32) for s in SHAPES]
    (spec,) = gf_tf.packing.plan_packs(signature, 0, wire.get(compression))
    devices = tuple(DEVICES[:2])
    _, (state,) = reducer.create_states([spec], devices)
    issued = []

    def all_reduce_sum(values):
        issued.append((values[0].dtype.name, int(values[0].shape[0])))
        return [tf.add_n(values)] * len(values)

    comm = reducers.Communicator(all_reduce_sum, 2, False, (0, 1), devices)
    grads = gradients(np.random.default_rng(4), 2)
    step = reducers.StepInput((reducers.PackStep(spec, [[tf.constant(g[i]) for i in spec.indices]
                                                        for g in grads], state),), None, comm)
    outputs, sent = reducer.reduce(step)
    assert [dtype for dtype, _ in issued] == collectives
    factor_sizes = [(36 + 12) * 2, (6 + 10) * 2]   # P's: n rank each; Q's: m rank each
    assert [size for _, size in issued[-2:]] == factor_sizes
    assert sent.figures == {"compressed_elements": 36 * 6 + 12 * 10,
                            "factor_elements": (36 + 6) * 2 + (12 + 10) * 2}
    assert len(outputs[0][1]) == len(SHAPES)


def _direct_step(reducer, spec, states, grads, issued):
    """One eager call of reducer.reduce on 2 replicas of one worker with a Communicator that
    appends (dtype, size) of each all-reduce to `issued`: (outputs, sent)."""
    devices = tuple(DEVICES[:2])
    shared, (state,) = states

    def all_reduce_sum(values):
        issued.append((values[0].dtype.name, int(values[0].shape[0])))
        return [tf.add_n(values)] * len(values)

    comm = reducers.Communicator(all_reduce_sum, 2, False, (0, 1), devices)
    step = reducers.StepInput((reducers.PackStep(spec, [[tf.constant(g[i]) for i in spec.indices]
                                                        for g in grads], state),), shared, comm)
    return reducer.reduce(step)


@pytest.mark.parametrize("compression, collectives", [
    (None, ["float32"] * 2),                    # the dense pack, then the P's or the Q's
    ("fp16", ["float32"] + ["float16"] * 2),   # the control vector first
])
def test_an_alternating_step_issues_one_all_reduce_for_the_ps_or_the_qs(compression, collectives):
    """Direct calls as above: the first step sends the P's of both matrices in one buffer, the
    second their Q's, the third the P's again; each step one factor all-reduce."""
    reducer = LowRank(rank=2, alternate=True, warmup_steps=0)
    signature = [(tf.TensorShape(s), tf.float32) for s in SHAPES]
    (spec,) = gf_tf.packing.plan_packs(signature, 0, wire.get(compression))
    states = reducer.create_states([spec], DEVICES[:2])
    rng = np.random.default_rng(4)
    p_size, q_size = (36 + 12) * 2, (6 + 10) * 2   # P's: n rank each; Q's: m rank each
    for t, size in enumerate([p_size, q_size, p_size]):
        issued = []
        outputs, sent = _direct_step(reducer, spec, states, gradients(rng, 2), issued)
        assert [dtype for dtype, _ in issued] == collectives
        assert issued[-1][1] == size
        assert int(sent.figures["factor_elements"]) == size
        assert [int(v.numpy()) for v in states[0].steps] == [t + 1] * 2
        assert len(outputs[0][1]) == len(SHAPES)


def test_a_restored_alternating_state_continues_on_its_phase():
    """3 steps (the next one sends the Q's), the set's arrays saved and assigned into a fresh
    state: the 4th step from the restored state issues the Q's and gives the same bits as the
    4th step of the original."""
    reducer = LowRank(rank=2, alternate=True, warmup_steps=0)
    signature = [(tf.TensorShape(s), tf.float32) for s in SHAPES]
    (spec,) = gf_tf.packing.plan_packs(signature, 0, wire.FP16)
    rng = np.random.default_rng(5)
    original = VariableSetState("set", [], signature, (spec,),
                                            *reducer.create_states([spec], DEVICES[:2]))
    for _ in range(3):
        _direct_step(reducer, spec, (original.shared, original.pack_states), gradients(rng, 2), [])
    saved = original.to_arrays()
    assert saved["step_r0"] == saved["step_r1"] == 3 and "p0_p_factor1_r1" in saved
    restored = VariableSetState("set", [], signature, (spec,),
                                            *reducer.create_states([spec], DEVICES[:2]))
    restored.assign_arrays(saved)
    grads = gradients(rng, 2)
    issued = []
    want, _ = _direct_step(reducer, spec, (original.shared, original.pack_states), grads, [])
    got, _ = _direct_step(reducer, spec, (restored.shared, restored.pack_states), grads, issued)
    assert issued[-1] == ("float16", (6 + 10) * 2)
    for a, b in zip(got[0][0], want[0][0]):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    for key, value in original.to_arrays().items():
        np.testing.assert_array_equal(restored.to_arrays()[key], value, err_msg=key)


def test_backup_and_restore_keeps_the_alternating_phase(tmp_path):
    """As the test above it for the two-collective form: fit preempted after epoch 1 and resumed
    under BackupAndRestore; the step counter, P and Q come back, and the resumed run ends with
    the uninterrupted run's weights and state, bit for bit."""
    saved, gfar_a, gfar_c = preempted_and_resumed(
        lambda: LowRank(rank=1, alternate=True, warmup_steps=0), tmp_path)
    assert saved["step_r0"] == saved["step_r1"] == 8
    assert {"p0_q0_r0", "p0_p_factor1_r1", "p0_residual_r1"} <= set(saved)
    assert gfar_c.stats.totals() == gfar_a.stats.totals()


@pytest.mark.parametrize("bad_variable", [0, 2])   # a compressed matrix; a dense bias
def test_a_non_finite_alternating_step_leaves_the_state_and_the_phase(bad_variable):
    run = Harness(2, LowRank(rank=2, alternate=True, warmup_steps=0), "fp16")
    rng = np.random.default_rng(6)
    for _ in range(3):
        run(gradients(rng, 2))
    _, state = run.spec_and_state()
    before = state.to_arrays()
    grads = gradients(rng, 2)
    grads[0][bad_variable].flat[3] = np.inf
    out = run(grads)
    assert not np.all(np.isfinite(out[1][bad_variable]))
    assert run.step_count() == 3
    for key, value in before.items():
        np.testing.assert_array_equal(state.to_arrays()[key], value, err_msg=key)
    run(gradients(rng, 2))
    assert run.step_count() == 4


def test_the_alternating_form_declares_itself_and_costs_one_factor():
    reducer = LowRank(rank=4, min_compression=3, alternate=True, warmup_steps=0)
    assert [(name, value) for name, value, _ in reducer.settings()] == [
        ("low-rank rank", 4), ("low-rank min_compression", 3.0), ("low-rank seed", 0),
        ("low-rank warmup_steps", 0), ("low-rank alternate", 1)]
    assert reducer.cost(1 << 20, wire.FP16).collective_bytes == (8, 2 * 1024 * 4)
    assert reducer.cost(1 << 20, wire.get(None)).collective_bytes == (4 * 1024 * 4,)
    assert reducer.cost(100, wire.get(None)).collective_bytes == (400,)   # 10 x 10: dense
    with pytest.raises(ValueError, match="alternate must be True or False, got 'yes'"):
        LowRank(alternate="yes")


WARMUP = 3


@pytest.mark.parametrize("alternate", [False, True])
@pytest.mark.parametrize("compression, rtol, scale", [(None, 1e-6, 1.0), ("fp16", 1e-3, 1e4)])
def test_warm_up_steps_are_dense_then_compression_starts_as_from_step_one(alternate, compression,
                                                                         rtol, scale):
    """LowRank(warmup_steps=3) on 2 replicas: steps 1 to 3 give every tensor's dense sum (the
    FP16 pack's rounding on that wire) and leave Q and the residuals at their first values while
    the count moves; step 4 matches the float64 model of a reducer without warm-up at its first
    step (the same Q, zero residuals; the alternating form sends the P's), and steps 5 and 6
    follow the model started there."""
    reducer = LowRank(rank=2, alternate=alternate, warmup_steps=WARMUP)
    run = Harness(2, reducer, compression)
    rng = np.random.default_rng(20)
    first = None
    for t in range(WARMUP):
        grads = gradients(rng, 2, scale=scale)
        out = run(grads)
        if first is None:
            spec, state = run.spec_and_state()
            first = state.to_arrays()
            dense = Model(reducer, spec, 2, fp16=compression == "fp16")
        want = dense.step(grads)
        for r in range(2):
            for got, expected in zip(out[r], want):
                assert_close(got, expected, rtol)
        assert run.step_count() == t + 1
        for key, value in state.to_arrays().items():
            np.testing.assert_array_equal(value, first[key], err_msg=key)
    assert not np.any(first["residual_r0"])
    model = Model(LowRank(rank=2, alternate=alternate, warmup_steps=0), spec, 2,
                  fp16=compression == "fp16")
    for t in range(3):
        grads = gradients(rng, 2, scale=scale)
        out = run(grads)
        want = model.step(grads)
        for r in range(2):
            for i, (got, expected) in enumerate(zip(out[r], want)):
                assert_close(got, expected, rtol), (t, r, i)
        for key, value in model.arrays().items():
            assert_close(state.to_arrays()[key], value, rtol), (t, key)
        assert run.step_count() == WARMUP + t + 1


def test_a_non_finite_warm_up_step_does_not_count():
    """An inf in a warm-up step reaches the outputs and leaves the count: the warm-up still
    takes 3 finite steps, on every worker alike (the flag is the all-reduced values')."""
    run = Harness(2, LowRank(rank=2, warmup_steps=WARMUP), "fp16")
    rng = np.random.default_rng(21)
    run(gradients(rng, 2))
    grads = gradients(rng, 2)
    grads[1][0].flat[2] = np.inf
    assert not np.all(np.isfinite(run(grads)[0][0]))
    assert run.step_count() == 1
    for _ in range(2):
        run(gradients(rng, 2))
    _, state = run.spec_and_state()
    assert run.step_count() == WARMUP and not np.any(state.to_arrays()["residual_r0"])
    run(gradients(rng, 2))
    assert np.any(state.to_arrays()["residual_r0"])


def test_backup_and_restore_keeps_the_warm_up_count(tmp_path):
    """fit preempted during the warm-up (10 steps; 8 run when the backup is written) and resumed
    under BackupAndRestore: the count comes back with the (zero) residuals, the resumed run
    switches to compression at the same step and ends with the uninterrupted run's weights and
    state, bit for bit."""
    saved, gfar_a, _ = preempted_and_resumed(lambda: LowRank(rank=1, warmup_steps=10), tmp_path)
    assert saved["step_r0"] == saved["step_r1"] == 8
    assert not np.any(saved["p0_residual_r0"]) and not np.any(saved["p0_residual_r1"])
    (variable_set,) = gfar_a.states().values()
    assert np.any(variable_set.to_arrays()["p0_residual_r0"])   # compressed after step 10


def test_a_warm_up_declares_its_count_and_a_direct_step_issues_the_dense_packs():
    """The set state holds the count ("step_r{r}"), with a warm-up or without one (so a
    checkpoint crosses warm-up lengths); a warm-up step called directly issues the dense
    reducer's collectives (the control vector, then the whole pack on its wire) and sends no
    factor."""
    signature = [(tf.TensorShape(s), tf.float32) for s in SHAPES]
    (spec,) = gf_tf.packing.plan_packs(signature, 0, wire.FP16)
    without = LowRank(rank=2, warmup_steps=0).create_states([spec], DEVICES[:2])[0]
    assert sorted(without.to_arrays()) == ["step_r0", "step_r1"]
    reducer = LowRank(rank=2, warmup_steps=1)
    states = reducer.create_states([spec], DEVICES[:2])
    assert sorted(states[0].to_arrays()) == ["step_r0", "step_r1"]
    issued = []
    _, sent = _direct_step(reducer, spec, states, gradients(np.random.default_rng(22), 2), issued)
    assert issued == [("float32", len(SHAPES)), ("float16", spec.num_elements)]
    assert int(sent.sent_bytes) == 2 * spec.num_elements + 4 * len(SHAPES)
    assert int(sent.figures["factor_elements"]) == 0
    assert [int(v.numpy()) for v in states[0].steps] == [1, 1]
    issued.clear()
    _, sent = _direct_step(reducer, spec, states, gradients(np.random.default_rng(23), 2), issued)
    assert [dtype for dtype, _ in issued] == ["float32"] + ["float16"] * 3
    assert int(sent.figures["factor_elements"]) == (36 + 6) * 2 + (12 + 10) * 2


@pytest.mark.slow   # 2 and 3 worker processes
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_get_the_same_bits_and_match_the_model(workers):
    """2 and 3 workers, one replica each, FP16 wire: every step's reduced values are bitwise equal
    on every worker, and so are the Q's they hold; each step matches the float64 model started
    from the state the workers held before it (worker w's residual as replica w's)."""
    import cluster   # pylint: disable=import-outside-toplevel
    results = cluster.run_workers("lowrank_worker.py", workers, ["--steps", "4"], timeout=150,
                                  comm_timeout=30)
    assert all(r.ok for r in results), cluster.describe(results)
    first, *others = (r.result for r in results)
    shapes = [(24, 16), (3, 3, 4, 8), (16,)]
    signature = [(tf.TensorShape(s), tf.float32) for s in shapes]
    (spec,) = gf_tf.packing.plan_packs(signature, 0, wire.FP16)
    reducer = LowRank(rank=2, warmup_steps=0)
    model = Model(reducer, spec, workers, fp16=True)
    for step in range(4):
        if step:
            held = [_state_before(r.result, step) for r in results]
            for key in (k for k in held[0] if k.startswith("q")):
                assert all(h[key].tobytes() == held[0][key].tobytes() for h in held), key
            model.load({**held[0], **{f"residual_r{w}": h["residual_r0"]
                                      for w, h in enumerate(held)}})
        grads = [[r.result[f"g{step}_{i}"] for i in range(len(shapes))] for r in results]
        want = model.step(grads)
        for i, expected in enumerate(want):
            key = f"out{step}_{i}"
            assert all(other[key].tobytes() == first[key].tobytes() for other in others), (step, i)
            assert_close(first[key], expected, 1e-3)


def _state_before(worker, step):
    """A worker's reducer state before `step`, under LowRankState's keys (one replica: r0)."""
    prefix = f"state{step}_p0_"
    return {key[len(prefix):]: value for key, value in worker.items() if key.startswith(prefix)}


def test_a_checkpoint_restores_across_warm_ups_and_one_without_a_count_keeps_compressing(tmp_path):
    """The warm-up only makes steps dense: a checkpoint of LowRank(warmup_steps=0) after 4
    compressed steps restores into warmup_steps=2 with its count (4, past the warm-up: every
    next step compressed); the same file without the count (as an earlier LowRank wrote it)
    restores into the default 50-step warm-up at count 50, and goes on compressing."""
    import h5py
    from helpers import regression_data, small_keras_model

    x, y = regression_data()

    def fit(warmup_steps, path=None):
        gfar = gf_tf.GradientFlowAllReduce(reducer=LowRank(rank=1, warmup_steps=warmup_steps),
                                           compression="fp16",
                                           cross_device_ops=tf.distribute.ReductionToOneDevice())
        gfar, model = small_keras_model(gfar)
        if path is not None:
            model.optimizer.build(model.trainable_variables)
            model.load_weights(path)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)   # 4 steps
        (variable_set,) = gfar.states().values()
        return gfar, model, [int(s.numpy()) for s in variable_set.shared.steps]

    gfar, model, counts = fit(0)
    assert counts == [4, 4]
    per_step = gfar.stats.totals()["figure_compressed_elements"] / 4
    assert per_step > 0
    path = str(tmp_path / "a.weights.h5")
    model.save_weights(path)

    gfar_b, _, counts = fit(2, path)
    assert counts == [8, 8]
    # CommStats come back with the checkpoint: its 4 steps and the 4 new ones, all compressed.
    assert gfar_b.stats.totals()["figure_compressed_elements"] == 8 * per_step

    with h5py.File(path, "r+") as f:
        group = f["optimizer/_gf_tf_checkpoint/vars"]
        steps = [key for key in group if key.startswith("s0_step_r")]
        assert sorted(steps) == ["s0_step_r0", "s0_step_r1"]
        for key in steps:
            del group[key]
    gfar_c, _, counts = fit(50, path)
    assert counts == [54, 54]
    assert gfar_c.stats.totals()["figure_compressed_elements"] == 8 * per_step
