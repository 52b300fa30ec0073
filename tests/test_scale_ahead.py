"""The dense reducer's float32 packs on the FP16 wire, scaled a step ahead (gf_tf.reducers.dense):
one collective a step, a float32 retry where the previous step's bound does not fit; every step
against a float64 reference and the retry rule's NumPy twin. 2-worker runs: test_collectives.py."""

import numpy as np
import pytest

from gf_tf import wire
from gf_tf.plan import planner
from gf_tf.reducers.dense import ScaleAhead, agreement_bits
from helpers import GIGABIT, Runner

SHAPES = [(1,), (7,), (1009,)]   # one pack of 1017 elements


def retries_of(steps):
    """Per step, whether the rule sends it again in float32 (NumPy twin of `wire.ahead_scale`
    and `wire.ahead_fits`): steps[s][r][t] is replica r's tensor t at step s."""
    previous, out = None, []
    for grads in steps:
        own = np.array([[np.max(np.abs(t)) for t in replica] for replica in grads], np.float64)
        if previous is None or not np.all(np.isfinite(previous)):
            out.append(True)
        else:
            summed = (own * wire.power_of_two_scale_np(previous) / 2 ** wire.AHEAD_HEADROOM_BITS
                      ).sum(0)
            fits = (np.isfinite(summed) & (summed <= wire.AHEAD_CEILING)
                    & ((summed >= wire.AHEAD_FLOOR) | ((own > 0).sum(0) == 0)))
            out.append(not fits.all())
        previous = own.sum(0)
    return out


def run_steps(steps, replicas):
    """Each step through one traced FP16 step (the same variables, so the same set and hints);
    asserts every step against float64 and the replicas' results bitwise equal. Returns the
    per-step retry counts of the "float32_retries" figure."""
    runner = Runner(replicas, None)
    retries, before = [], 0.0
    for s, grads in enumerate(steps):
        out = runner(grads)
        total = runner.gfar.stats.totals()["figure_float32_retries"]
        retried, before = total - before, total
        retries.append(bool(retried))
        for t in range(len(SHAPES)):
            values = np.array([np.asarray(g[t], np.float64) for g in grads])
            ref, magnitude = values.sum(0), np.abs(values).sum(0)
            bound = np.abs(values).reshape(replicas, -1).max(1).sum()
            got = out[0][t]
            for replica in out[1:]:
                np.testing.assert_array_equal(replica[t].view(np.uint32), got.view(np.uint32))
            if not np.all(np.isfinite(values)):
                np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
                continue
            # A retry sums float32 (replicas - 1 roundings of each partial sum); FP16 rounds each
            # of 2N times (casts, partial sums, the output) by at most half an ulp of the bound.
            tolerance = (replicas * 2.0 ** -24 * magnitude if retried
                         else 2.0 ** -10 * replicas * bound)
            assert np.all(np.abs(got - ref) <= tolerance), (s, t, np.max(np.abs(got - ref)))
    return retries


def gradients(rng, replicas, scales):
    """Fresh values of magnitude 0.5 to 1 times each tensor's scale, either sign: each step's
    maxima stay within 2x of the scale, so the steps that retry are the ones the test names."""
    return [[(rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.0, shape) * scale
              ).astype(np.float32) for shape, scale in zip(SHAPES, scales)]
            for _ in range(replicas)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_steps_that_grow_shrink_and_start_from_zero_match_float64_and_the_rule(replicas):
    """First step (no bound: retry), steady steps (FP16), a 1000x jump (past the headroom:
    retry), a 1e-6 drop (would flush: retry), a tensor that goes from 0 to 1e-8 (retry, not
    flushed to 0), values whose SUM passes 65504 (scaled below it). A jump retries for every
    draw only past 2 * 2**(AHEAD_HEADROOM_BITS + 1) = 128x (a step's maxima span 2x, the
    previous bound's power of two up to 2x more): 1000 / 1.3 is past it, 100 / 1.3 is not."""
    rng = np.random.default_rng()
    plan = [(1, 1, 1), (1, 1, 1), (1.3, 0.7, 1), (1000, 1, 1), (1000, 1, 1), (1e-3, 1, 1),
            (1e-3, 1, 1), (1e-3, 0, 1), (1e-3, 0, 1), (1e-3, 1e-8, 1), (1e-3, 1e-8, 1),
            (1e-3, 1e-8, 3e4), (1e-3, 1e-8, 3e4)]
    steps = [gradients(rng, replicas, scales) for scales in plan]
    expected = retries_of(steps)
    assert expected == [True, False, False, True, False, True, False, False, False, True,
                        False, True, False]
    assert run_steps(steps, replicas) == expected


def test_a_nan_stays_nan_and_the_next_steps_recover():
    """A NaN in one tensor: that step goes again in float32 (the NaN where it was, the pack's
    other tensors exact), the next has no finite bound (retry), the one after is FP16 again."""
    rng = np.random.default_rng()
    steps = [gradients(rng, 2, (1, 1, 1)) for _ in range(5)]
    steps[2][1][2][5] = np.nan
    steps[2][0][0][0] = np.inf
    expected = retries_of(steps)
    assert expected == [True, False, True, True, False]
    assert run_steps(steps, 2) == expected


def test_the_bounds_are_hints_kept_per_pack_out_of_the_checkpoint():
    runner = Runner(2, None)
    rng = np.random.default_rng()
    grads = gradients(rng, 2, (1, 1, 1))
    runner(grads)
    (state,) = runner.gfar.states().values()
    assert not state.has_state and state.to_arrays() == {}
    (hints,), (spec,) = state.hints, state.pack_specs
    assert isinstance(hints, ScaleAhead) and len(hints.bounds) == 2
    expected = np.sum([[np.max(np.abs(replica[i])) for i in spec.indices] for replica in grads], 0)
    for bound in hints.bounds:   # the float32 retry's exact sums
        np.testing.assert_allclose(bound.numpy(), expected, rtol=2 ** -23)


def test_the_planner_prices_the_dense_reducers_fp16_without_a_control_collective():
    elements, tensors = 300_000, 40
    with_control = planner.predict_seconds("fp16", "ring", elements, tensors, 2, GIGABIT)
    ahead = planner.predict_seconds("fp16", "ring", elements, tensors, 2, GIGABIT, control=False)
    slots = (planner.collective_seconds("ring", 2 * (elements + wire.ahead_slots(tensors)), 2, GIGABIT)
             - planner.collective_seconds("ring", 2 * elements, 2, GIGABIT))
    assert with_control - ahead == pytest.approx(
        planner.collective_seconds("ring", 4 * tensors, 2, GIGABIT) - slots)
    assert planner.predict_seconds("fp16", "ring", elements, tensors, 2, GIGABIT, groups=4,
                                   control=False) == ahead
    plan = planner.choose(elements, tensors, 2, GIGABIT, "fp16", "ring", overlap="auto",
                          control=False).plan
    assert plan.groups == 1


def test_a_run_resumed_by_backup_and_restore_scales_as_the_uninterrupted_one_bitwise(tmp_path):
    """fit for 3 epochs on the FP16 wire, once uninterrupted and once preempted after epoch 1
    and restarted under BackupAndRestore: the checkpoint keeps the bounds a step ahead, so the
    restarted run sends no extra float32 retry and ends with the same weights, bit for bit."""
    from gf_tf.keras.backup import BackupAndRestore
    from test_checkpoint import _Interrupt, _data, _setup
    x, y = _data()
    gfar_a, model_a = _setup(sparsity=False)
    model_a.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    backup = str(tmp_path / "backup")
    _, model_b = _setup(sparsity=False)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        model_b.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    callbacks=[BackupAndRestore(backup), _Interrupt(epoch=1)])
    gfar_c, model_c = _setup(sparsity=False, seed=5)
    model_c.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                callbacks=[BackupAndRestore(backup)])
    retries = gfar_a.stats.totals()["figure_float32_retries"]
    assert 1 <= retries < 12 and gfar_c.stats.totals()["figure_float32_retries"] == retries
    for a, c in zip(model_a.get_weights(), model_c.get_weights()):
        np.testing.assert_array_equal(a, c)


def test_replicas_whose_bounds_differ_retry_instead_of_summing_other_scales():
    """Replica 1's bounds a step ahead made 16x larger (as a checkpoint from another step could
    leave them): its hash bits differ, every replica sees ones and zeros counted for some bit,
    and the pack goes again in float32 (exact), where 1/16 of its values would have summed."""
    rng = np.random.default_rng()
    runner = Runner(2, None)
    runner(gradients(rng, 2, (1, 1, 1)))
    (state,) = runner.gfar.states().values()
    (hints,) = state.hints
    hints.bounds[1].assign(hints.bounds[1] * 16.0)
    grads = gradients(rng, 2, (1, 1, 1))
    out = runner(grads)
    assert runner.gfar.stats.totals()["figure_float32_retries"] == 2
    for t in range(len(SHAPES)):
        np.testing.assert_array_equal(out[0][t], grads[0][t] + grads[1][t])
    hints.bounds[1].assign(hints.bounds[0])   # the retry's exact bounds: equal again
    runner(gradients(rng, 2, (1, 1, 1)))
    assert runner.gfar.stats.totals()["figure_float32_retries"] == 2


def test_the_agreement_bits_follow_every_bound():
    rng = np.random.default_rng(3)
    for size in (1, 7, 1009):
        bounds = rng.uniform(0, 10, size).astype(np.float32)
        bits = agreement_bits(bounds).numpy()
        assert bits.shape == (wire.AGREEMENT_BITS,) and set(bits) <= {0.0, 1.0}
        np.testing.assert_array_equal(agreement_bits(bounds.copy()).numpy(), bits)
        for t in {0, size // 2, size - 1}:
            for other in (np.nextafter(bounds[t], np.inf), 2 * bounds[t], np.nan):
                changed = bounds.copy()
                changed[t] = other
                assert np.any(agreement_bits(changed).numpy() != bits), (size, t, other)
