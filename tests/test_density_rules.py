"""CSC density rules are objects (`gf_tf.csc.density.DensityRule`): each holds and checks its own
settings, and a rule of your own is passed as `ChunkSparsity(density=rule)`.

The rule here ("alternate": after the warm-up, steps alternate between two densities by the step
counter) is defined in this file, runs through GradientFlowAllReduce under MirroredStrategy on 2
logical CPUs, and is checked against the float64 NumPy model of CSC at the same densities.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.csc import AutoDensity, DensityRule, FixedDensity

from csc_reference import NumpyCSC, chunks_zero, flatten, pack_order, spread_gradients
from helpers import Runner


class AlternatingDensity(DensityRule):
    """density=AlternatingDensity(a, b): after the warm-up, even steps at a, odd steps at b."""
    value, code = "alternate", -2.0

    def __init__(self, first: float, second: float):
        self.densities = (float(first), float(second))
        self.floor = min(self.densities)

    def rungs(self):
        return self.densities

    def candidates(self):
        return tuple((None, d) for d in self.densities)

    def config(self):
        return {"alternate": list(self.densities)}

    def index(self, stage, current, plans, timing, comm, warmup_steps, shared):
        staged = sum(plan.first_step is not None for plan in plans)
        chosen = tf.cast(current % 2, tf.int32)
        return tf.where(current >= warmup_steps, staged + chosen, stage)


def test_a_rule_from_outside_gf_tf_trains_as_the_numpy_model_of_its_densities():
    cs, replicas, warmup = 16, 2, 2
    shapes = [(7, 3), (1009,)]            # 1030 elements: 65 chunks, the last of 6
    rule = AlternatingDensity(0.25, 0.05)
    csc = gf_tf.ChunkSparsity(density=rule, chunk_size=cs, warmup_steps=warmup)
    assert csc.density_rule is rule and csc.density == "alternate" and csc.min_density == 0.05
    assert csc.candidates() == ((0, 1.0), (None, 0.25), (None, 0.05))
    assert csc.get_config()["alternate"] == [0.25, 0.05]
    run = Runner(replicas, csc, compression=None)
    order = pack_order(shapes)
    model = NumpyCSC(1030, replicas, cs)
    rng = np.random.default_rng(11)
    for step in range(warmup + 4):
        density = 1.0 if step < warmup else rule.densities[step % 2]
        grads = spread_gradients(rng, shapes, order, replicas, cs)
        out = run(grads)
        ref, idx = model.step([flatten(g, order) for g in grads], density)
        sent = 65 if idx is None else len(idx)
        assert sent == (65 if density == 1.0 else math.ceil(density * 65)), (step, sent)
        for r in range(replicas):
            got = flatten(out[r], order)
            if idx is not None:
                np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(got, cs)), idx)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for r, residual in enumerate(run.residuals()):
            np.testing.assert_allclose(residual, model.residual[r], rtol=1e-5,
                                       atol=1e-5 * np.abs(model.residual[r]).max() + 1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_density=0.0), "min_density"), (dict(min_density=1.5), "min_density"),
    (dict(min_density="0.01"), "min_density"), (dict(budget=0.0), "auto_budget"),
    (dict(budget=float("inf")), "auto_budget"), (dict(budget=True), "auto_budget")])
def test_the_auto_rule_checks_its_own_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoDensity(**kwargs)


@pytest.mark.parametrize("density", [0.0, 1.5, True, "0.5"])
def test_the_fixed_rule_checks_its_own_density(density):
    with pytest.raises(ValueError, match="density must be a fraction"):
        FixedDensity(density)


def test_chunk_sparsity_hands_its_auto_settings_to_the_rule_and_reads_them_back():
    csc = gf_tf.ChunkSparsity(density="auto", min_density=0.003, auto_budget=0.2)
    assert isinstance(csc.density_rule, AutoDensity) and not isinstance(csc.density_rule, FixedDensity)
    assert (csc.density_rule.floor, csc.density_rule.budget) == (0.003, 0.2)
    assert (csc.min_density, csc.auto_budget) == (0.003, 0.2)
    rule = AutoDensity(min_density=0.03, budget=0.1)
    given = gf_tf.ChunkSparsity(density=rule)
    assert given.density_rule is rule and given.get_config()["min_density"] == 0.03
    assert given.rungs() == (1.0, 0.25, 0.1, 0.03)
    with pytest.raises(ValueError, match="belong to density=\"auto\""):
        gf_tf.ChunkSparsity(density=rule, min_density=0.1)
