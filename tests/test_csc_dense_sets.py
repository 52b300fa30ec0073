"""Sets CSC never compresses travel as the dense reducer's FP16 packs (gf_tf.csc.dense_sets):
which sets, the same sums and bytes as GradientFlowAllReduce() without CSC, CSC's counts of a
dense step, and a residual a checkpoint brought sent with the next step and cleared."""

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf import packing, wire
from gf_tf.csc import dense_sets
from gf_tf.csc.density import MIN_CHUNKS
from helpers import Runner


def specs_of(elements):
    """The pack specs of one float32 gradient of `elements` on the FP16 wire, packs of 4 MiB."""
    return packing.plan_packs([(tf.TensorShape([elements]), tf.float32)], 4 << 20,
                              wire.format_of("fp16"))


@pytest.mark.parametrize("sparsity, chunks, expected", [
    (dict(), MIN_CHUNKS, True),                           # auto sends at least MIN_CHUNKS a pack
    (dict(), MIN_CHUNKS + 1, False),
    (dict(density=1.0), 1000, True),
    (dict(density=0.5), 2, False),                        # one of two chunks
    (dict(density=0.5), 1, True),
    (dict(momentum=0.9), 1, False),                       # a velocity to keep
    (dict(density=0.01, selection="global"), 1, True),
    (dict(density=0.01, selection="ahead"), 3, False),
])
def test_which_sets_csc_never_compresses(sparsity, chunks, expected):
    csc = gf_tf.ChunkSparsity(chunk_size=16, **sparsity)
    assert dense_sets.never_compressed(csc, specs_of(16 * chunks - 5)) is expected


def test_a_set_csc_never_compresses_sums_and_sends_as_the_dense_reducer():
    """ChunkSparsity() on a set of 7 + 50 elements in chunks of 16 (4 chunks, below auto's
    floor): every step bitwise the dense reducer's (FP16 scaled a step ahead, the first step
    a float32 retry, the others FP16: their bounds stay within 2x), its bytes and retries the
    same, CSC's counts those of a dense step."""
    rng = np.random.default_rng()
    csc = Runner(2, gf_tf.ChunkSparsity(chunk_size=16))
    dense = Runner(2, None)
    for step in range(4):
        grads = [[(rng.normal(size=n) * scale).astype(np.float32)
                  for n, scale in ((7, 1e-3), (50, 1e2))] for _ in range(2)]
        a, b = csc(grads), dense(grads)
        for r in range(2):
            for x, y in zip(a[r], b[r]):
                np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=f"step {step}")
        reference = [np.sum([g[t].astype(np.float64) for g in grads], 0) for t in range(2)]
        for got, want in zip(a[0], reference):
            tolerance = 2 ** -24 * 4 if step == 0 else 2 ** -9 * np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=tolerance if step == 0 else 0,
                                       atol=0 if step == 0 else tolerance)
    got, want = csc.gfar.stats.totals(), dense.gfar.stats.totals()
    for key in ("steps", "dense_bytes", "sent_bytes", "figure_float32_retries"):
        assert got[key] == want[key], key
    assert got["figure_float32_retries"] == 1
    assert got["selected_chunks"] == got["total_chunks"] == 4 * 4
    assert got["densities"] == 4.0
    state = csc.state()
    assert [int(s.numpy()) for s in state.steps] == [4, 4]


def test_a_residual_from_a_checkpoint_is_sent_with_the_next_step_and_cleared():
    """A residual such a set holds (restored from a run at a density that compressed it) is
    added to the next step's gradients (float64 reference), then 0; CSC's residual norm too."""
    rng = np.random.default_rng()
    run = Runner(2, gf_tf.ChunkSparsity(chunk_size=16), compression=None)
    grads = [[rng.normal(size=n).astype(np.float32) for n in (7, 50)] for _ in range(2)]
    run(grads)
    state = run.state()
    residuals = [rng.normal(size=57).astype(np.float32) for _ in range(2)]
    for variable, value in zip(state.residuals, residuals):
        variable.assign(value)
    grads = [[rng.normal(size=n).astype(np.float32) for n in (7, 50)] for _ in range(2)]
    out = run(grads)
    (spec,) = next(iter(run.gfar.states().values())).pack_specs   # the residual's order
    in_pack_order = lambda tensors: np.concatenate([tensors[i] for i in spec.indices])
    terms = [(in_pack_order(g).astype(np.float64), res) for g, res in zip(grads, residuals)]
    want = np.sum([g + res for g, res in terms], 0)
    magnitude = np.sum([np.abs(g) + np.abs(res) for g, res in terms], 0)
    # float32: g + residual on each replica, then their sum: 3 roundings of at most 2**-24
    assert np.all(np.abs(in_pack_order(out[0]) - want) <= 3 * 2 ** -24 * magnitude)
    np.testing.assert_array_equal(in_pack_order(out[1]), in_pack_order(out[0]))
    assert not np.any(run.residuals()[0]) and not np.any(run.residuals()[1])
    assert float(state.residual_l1.numpy()) == 0.0
