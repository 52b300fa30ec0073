"""CSC's selection policies are registered objects: a policy of your own is one class plus one
`gf_tf.csc.policies.register` call, and the CSC step asks the policy and the density rule
instead of testing their names.

The fourth policy here ("quietest": each pack sends the k chunks with the smallest all-reduced
L1 norms) is defined in this file, runs through GradientFlowAllReduce under MirroredStrategy on
2 logical CPUs, and is checked against a float64 NumPy model of the same policy.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.csc import PerPackSelection, policies

from csc_reference import NumpyCSC, chunks_zero, flatten, pack_order, spread_gradients
from helpers import Runner

CSC = pathlib.Path(gf_tf.__file__).parent / "csc"


class QuietestSelection(PerPackSelection):
    """selection="quietest": each pack sends its k chunks with the smallest all-reduced
    L1 norms, ties to the lower index, ascending."""
    name = "quietest"

    def select(self, norms, k):
        _, indices = tf.math.top_k(-norms, k=k, sorted=True)
        return tf.sort(indices)


class NumpyQuietest(NumpyCSC):
    """QuietestSelection in float64."""

    def choose(self, norms, k):
        return np.sort(np.lexsort((np.arange(self.c), norms))[:k])


@pytest.fixture
def quietest():
    policies.register(QuietestSelection())
    try:
        yield "quietest"
    finally:
        policies.unregister("quietest")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_policy_registered_from_outside_trains_as_its_numpy_model(quietest, momentum):
    cs, density, steps, replicas = 16, 0.1, 5, 2
    shapes = [(7, 3), (1009,)]            # 1030 elements: 65 chunks, the last of 6; k = 7
    csc = gf_tf.ChunkSparsity(density=density, chunk_size=cs, momentum=momentum,
                              selection=quietest)
    run = Runner(replicas, csc, compression=None)
    order = pack_order(shapes)
    model = NumpyQuietest(1030, replicas, cs, momentum)
    rng = np.random.default_rng(7)
    for _ in range(steps):
        grads = spread_gradients(rng, shapes, order, replicas, cs)
        out = run(grads)
        ref, idx = model.step([flatten(g, order) for g in grads], density)
        assert len(idx) == 7
        for r in range(replicas):
            got = flatten(out[r], order)
            np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(got, cs)), idx)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for r, residual in enumerate(run.residuals()):
            np.testing.assert_allclose(residual, model.residual[r], rtol=1e-5,
                                       atol=1e-5 * np.abs(model.residual[r]).max())
        if momentum:
            for r, u in enumerate(run.state().velocities):
                np.testing.assert_allclose(u.numpy(), model.velocity[r], rtol=1e-5,
                                           atol=1e-5 * np.abs(model.velocity[r]).max())
    assert int(run.state().step.numpy()) == steps
    # The largest-norm chunks stay in the residual: the policy, not top k, chose.
    assert np.abs(model.residual).sum() > np.abs(ref).sum()


def test_the_registry_names_its_policies_and_refuses_duplicates_and_built_in_removals(quietest):
    assert tuple(policies.POLICIES)[:3] == policies.BUILT_IN == gf_tf.csc.SELECTIONS
    csc = gf_tf.ChunkSparsity(density=0.01, selection=quietest)
    assert csc.policy is policies.POLICIES["quietest"] and csc.overlaps
    assert csc.get_config()["selection"] == "quietest" and "selection='quietest'" in repr(csc)
    assert csc.step_bytes(1024 * 1000) == gf_tf.ChunkSparsity(selection="per_pack").step_bytes(1024 * 1000)
    with pytest.raises(ValueError, match=r"one of \('per_pack', 'global', 'ahead', 'quietest'\)"):
        gf_tf.ChunkSparsity(selection="loudest")
    with pytest.raises(ValueError, match="new name"):
        policies.register(QuietestSelection())
    with pytest.raises(ValueError, match="built in"):
        policies.unregister("ahead")


def test_an_unregistered_policy_is_unknown_again():
    policies.register(QuietestSelection())
    policies.unregister("quietest")
    with pytest.raises(ValueError, match=r"one of \('per_pack', 'global', 'ahead'\) .*got 'quietest'"):
        gf_tf.ChunkSparsity(selection="quietest")


@pytest.mark.parametrize("module", ["reducer.py", "sparsity.py"])
def test_the_step_and_chunk_sparsity_test_no_selection_or_density_by_name(module):
    source = (CSC / module).read_text()
    for pattern in (r'==\s*"ahead"', r'!=\s*"ahead"', r"\bselection\s*[!=]=", r"\bsparsity\.auto\b",
                    r"\bself\.auto\b", r"\b_ahead\b", r"scores is not None",
                    r'density\s*==\s*"auto"', r"policy\.name\s*=="):
        assert not re.search(pattern, source), (module, pattern)
