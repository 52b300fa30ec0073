"""CSC with selection="ahead" (gf_tf.csc.ahead) against its NumPy float64 model, on real TF
collectives (MirroredStrategy over logical CPU devices; across processes: the multi-worker
tests)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import gf_tf

from csc_reference import NumpyAheadCSC, chunks_zero, flatten, pack_order
from helpers import Runner, all_ops


def _scaled_grads(rng, shapes, num_replicas, cs, n):
    """Per replica the gradients, chunk magnitudes spread 0.1..10 so rankings are clear."""
    order = pack_order(shapes)
    scale = rng.permutation(np.repeat(np.linspace(0.1, 10.0, -(-n // cs)), cs)[:n])
    grads = []
    for _ in range(num_replicas):
        flat = rng.normal(size=n) * scale
        parts = np.split(flat, np.cumsum([int(np.prod(shapes[i])) for i in order])[:-1])
        replica = [None] * len(shapes)
        for i, part in zip(order, parts):
            replica[i] = part.reshape(shapes[i]).astype(np.float32)
        grads.append(replica)
    return grads


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("momentum, scoring", [(0.0, "error_feedback"), (0.9, "error_feedback"),
                                               (0.0, "paper"), (0.9, "paper")])
def test_matches_numpy_model_over_20_steps(num_replicas, momentum, scoring):
    cs, density, warmup, steps = 16, 0.1, 2, 20
    shapes, n = [(7, 3), (1009,)], 1030      # 65 chunks, the last of 6 elements
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=cs, momentum=momentum,
                              warmup_steps=warmup, selection="ahead", scoring=scoring)
    run = Runner(num_replicas, csc, compression=None)
    order = pack_order(shapes)
    model = NumpyAheadCSC(n, num_replicas, cs, momentum, scoring)
    rng = np.random.default_rng(num_replicas)
    for step in range(steps):
        grads = _scaled_grads(rng, shapes, num_replicas, cs, n)
        out = run(grads)
        ref, idx = model.step([flatten(g, order) for g in grads], density, warmup=step < warmup)
        for r in range(num_replicas):
            got = flatten(out[r], order)
            np.testing.assert_array_equal(got, flatten(out[0], order))
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            if step >= warmup:
                np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(got, cs)), idx)
        for r, residual in enumerate(run.residuals()):
            np.testing.assert_allclose(residual, model.pack.residual[r], rtol=1e-5,
                                       atol=1e-4 * max(1.0, np.abs(model.pack.residual).max()))
        state = run.state()
        for r in range(num_replicas):
            np.testing.assert_allclose(state.scores[r].numpy(), model.scores, rtol=1e-5)
            np.testing.assert_array_equal(state.scores[r].numpy(), state.scores[0].numpy())
            np.testing.assert_allclose(state.bounds[r].numpy(), model.bound, rtol=1e-5)
    assert int(state.step.numpy()) == steps


def _one_pack(n, cs, density, warmup_steps=0, **kwargs):
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=cs, warmup_steps=warmup_steps,
                              selection="ahead", **kwargs)
    return Runner(2, csc, compression="fp16", bytes_per_pack=0), NumpyAheadCSC(n, 2, cs, **kwargs)


def _overflow_at_step_6(n):
    """(step, float32 [2, n] gradients of 2 replicas) for steps 0-8, step 6's 4096x the rest."""
    rng = np.random.default_rng(7)
    for step in range(9):
        yield step, rng.normal(size=(2, n)).astype(np.float32) * (4096.0 if step == 6 else 1.0)


def test_fp16_wire_matches_the_model_and_an_overflow_is_resent_in_float32():
    """Steps 0-1 dense; 2-5 on FP16 (errors of FP16's rounding); step 6's gradients are 4096x
    step 5's, past the scale's 16x headroom: its FP16 sum overflows on every worker alike and
    is all-reduced again in float32, so it matches the model to float32 precision."""
    n, cs, density = 1009, 16, 0.1
    run, model = _one_pack(n, cs, density, warmup_steps=2)
    errors = []
    for step, g in _overflow_at_step_6(n):
        out = run([[g[0]], [g[1]]])
        ref, idx = model.step(g, density, warmup=step < 2)
        np.testing.assert_array_equal(out[0][0], out[1][0])
        error = np.abs(out[0][0] - ref).max() / np.abs(ref).max()
        errors.append(error)
        assert error < (1e-6 if step == 6 else 2e-3), (step, error)
        if step >= 2:
            np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(out[0][0], cs)), idx)
    assert min(errors[2:6]) > 1e-5   # those steps did travel as FP16


def test_comm_stats_count_each_fp16_overflow_resent_in_float32():
    """The overflow of the test above (step 6, gradients 4096x) is one float32 retry in
    CommStats ("float32_retries_per_step"); the dense warm-up steps and the FP16 steps that
    fit count none, nor does a first sparse step that goes float32 at once (no bound yet)."""
    run, _ = _one_pack(1009, 16, 0.1, warmup_steps=2)
    retries = []
    for _, g in _overflow_at_step_6(1009):
        run([[g[0]], [g[1]]])
        retries.append(run.gfar.stats.totals()["figure_float32_retries"])
    assert retries == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert run.gfar.stats.result()["float32_retries_per_step"] == pytest.approx(1 / 9)

    cold, _ = _one_pack(100, 10, 0.2)
    for _ in range(3):
        cold([[np.full(100, 1e-3, np.float32)]] * 2)
    assert cold.gfar.stats.totals()["figure_float32_retries"] == 0


def test_a_first_sparse_step_without_warmup_travels_in_float32():
    """No bound yet: nothing to scale FP16 by, so the first step is exact (and chooses the
    first k chunks: every score is 0); the next ones travel as FP16."""
    n, cs, density = 100, 10, 0.2
    run, model = _one_pack(n, cs, density)
    rng = np.random.default_rng(1)
    for step in range(3):
        g = (rng.normal(size=(2, n)) * 1e-3).astype(np.float32)
        out = run([[g[0]], [g[1]]])
        ref, idx = model.step(g, density)
        if step == 0:
            np.testing.assert_array_equal(idx, [0, 1])
            np.testing.assert_allclose(out[0][0], ref, rtol=1e-6, atol=0)
        else:
            np.testing.assert_allclose(out[0][0], ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_gradient_outside_the_sent_chunks_poisons_the_step_and_keeps_the_state(bad):
    n, cs, density = 40, 4, 0.25
    run, _ = _one_pack(n, cs, density, warmup_steps=1)
    rng = np.random.default_rng(2)
    for _ in range(2):
        run([[rng.normal(size=n).astype(np.float32)] for _ in range(2)])
    state = run.state()
    before = {k: v.copy() for k, v in _arrays(run).items()}
    sent = np.flatnonzero(~chunks_zero(run([[np.ones(n, np.float32)]] * 2)[0][0], cs))
    after_ok = _arrays(run)
    bad_chunk = next(c for c in range(n // cs) if c not in sent)
    g = np.ones(n, np.float32)
    g[bad_chunk * cs] = bad
    for key, value in after_ok.items():
        before[key] = value
    out = run([[g], [np.ones(n, np.float32)]])
    for replica in out:   # its sent chunks come out NaN, for a loss-scale optimizer to skip
        assert np.all(np.isnan(replica[0]) == ~chunks_zero(replica[0], cs).repeat(cs)), replica
    for key, value in _arrays(run).items():
        if not key.startswith("step"):
            np.testing.assert_array_equal(value, before[key], err_msg=key)
    assert int(state.step.numpy()) == 4


def _arrays(run):
    (variable_set,) = run.gfar.states().values()
    return {k.split("_", 1)[1]: np.array(v) for k, v in variable_set.to_arrays().items()}


def test_the_chosen_chunks_are_state_a_restore_replays_the_steps_bit_for_bit():
    n, cs, density = 1009, 16, 0.05
    run, _ = _one_pack(n, cs, density, warmup_steps=2, momentum=0.9)
    rng = np.random.default_rng(4)
    grads = [rng.normal(size=(2, n)).astype(np.float32) for _ in range(8)]
    for g in grads[:4]:
        run([[g[0]], [g[1]]])
    (variable_set,) = run.gfar.states().values()
    saved = {k: np.array(v) for k, v in variable_set.to_arrays().items()}
    assert sorted(k for k in saved if k.endswith("_r0")) == [
        "p0_bound_r0", "p0_residual_r0", "p0_scores_r0", "p0_step_r0", "p0_velocity_r0"]
    first = [run([[g[0]], [g[1]]])[0][0] for g in grads[4:]]
    variable_set.assign_arrays(saved)
    again = [run([[g[0]], [g[1]]])[0][0] for g in grads[4:]]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_a_sparse_step_is_one_fp16_sum_and_a_float32_one_only_in_its_retry():
    """The traced step of one pack (1009 elements, 64 chunks of 16, k = 4): the sparse branch
    sums ONE float16 buffer of its chunks, next scores and bound (4 * 16 + 64 + 1); its
    float32 twin is the retry, in a cond; the dense warm-up branch sums the norms, then the pack."""
    n, cs = 1009, 16
    run, _ = _one_pack(n, cs, 0.05, warmup_steps=1)
    run([[np.ones(n, np.float32)]] * 2)
    inputs = run.strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.ones([n]),))
    graph = run._step.get_concrete_function(inputs).graph   # pylint: disable=protected-access
    sums = sorted((op.get_attr("T").name, op.outputs[0].shape.num_elements())
                  for op in all_ops(graph) if op.type == "AddN"
                  and op.outputs[0].shape.num_elements() not in (None, 1))
    assert sums == sorted([("float16", 4 * 16 + 64 + 1), ("float32", 4 * 16 + 64 + 1),
                           ("float32", 64), ("float16", n)]), sums


@pytest.mark.parametrize("momentum, scoring, fused", [(0.9, "error_feedback", True),
                                                     (0.9, "paper", False),
                                                     (0.0, "error_feedback", False)])
def test_error_feedback_scores_come_from_the_accumulate_kernels_lookahead_norms(
        momentum, scoring, fused):
    """With momentum, scoring "error_feedback" asks the accumulate op for its lookahead norms
    (one per chunk), so the sparse branch sums no [C, chunk_size] block of residual +
    momentum * u (buffers.chunk_l1): the only such sums are the dense branch's, of its
    received buffer."""
    n, cs = 1009, 16
    run, _ = _one_pack(n, cs, 0.05, warmup_steps=1, momentum=momentum, scoring=scoring)
    run([[np.ones(n, np.float32)]] * 2)
    inputs = run.strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.ones([n]),))
    graph = run._step.get_concrete_function(inputs).graph   # pylint: disable=protected-access
    accumulates = [op for op in all_ops(graph) if op.type == "GfAccumulate"]
    assert len(accumulates) == 2   # one per replica
    assert all(op.get_attr("with_lookahead") == fused for op in accumulates)
    chunk_sums = [op for op in all_ops(graph) if op.type == "Sum"
                  and op.inputs[0].shape.as_list() == [-(-n // cs), cs]]
    # Only the dense branch's chunk_l1 of its received sum, per replica.
    assert len(chunk_sums) == 2, [op.name for op in chunk_sums]


def test_settings_name_what_ahead_does_not_combine_with():
    with pytest.raises(ValueError, match=r'selection="ahead" needs a numeric density'):
        gf_tf.ChunkSparsity(density="auto", selection="ahead")
    with pytest.raises(ValueError, match=r'selection="ahead" needs a numeric density'):
        gf_tf.ChunkSparsity(selection="ahead")   # the default density is "auto"
    with pytest.raises(ValueError, match=r"scoring must be one of \('error_feedback', 'paper'\)"):
        gf_tf.ChunkSparsity(density=0.01, selection="ahead", scoring="l2")
    with pytest.raises(ValueError, match=r"scoring='paper' .* only selection=\"ahead\" does; got selection='per_pack'"):
        gf_tf.ChunkSparsity(density=0.01, scoring="paper")
    csc = gf_tf.ChunkSparsity(density=0.01, selection="ahead", scoring="paper")
    assert "selection='ahead', scoring='paper'" in repr(csc)
    assert csc.get_config()["scoring"] == "paper" and csc.overlaps
    assert "scoring" not in gf_tf.ChunkSparsity().get_config()
    terms = csc.reducer().cost(1024 * 1000, gf_tf.wire.FORMATS["fp16"])
    assert terms.collective_bytes == (2 * 1024 * 10 + 2 * 1001,) and terms.groupable
