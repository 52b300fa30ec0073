"""A pack carries its wire format (gf_tf.packing.PackSpec.wire): "is this scaled?" has one answer.

Registering `WireFormat("bf16_scaled", tf.bfloat16, scaled=True)` scales the packs that travel on it
and no others: compression="bf16" packs and native bfloat16 gradients keep the unscaled built-in
format, and on every registered format the dense reducer sends its scale bounds in the pack (a step
ahead, gf_tf.reducers.dense) where the format is scaled, and the planner prices no control collective.
"""

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import collectives, wire
from gf_tf.plan import Costs, planner
from helpers import fp16_pack_bytes
from test_cross_device_ops import batch_reduce, make

BF16 = tf.bfloat16.as_numpy_dtype
RNG = np.random.default_rng(36)
SHAPES = [(5, 3), (40,), (7,)]


@pytest.fixture
def bf16_scaled():
    """`bf16_scaled` registered for one test; FORMATS restored after."""
    saved = dict(wire.FORMATS)
    yield wire.register(wire.WireFormat("bf16_scaled", tf.bfloat16, scaled=True))
    wire.FORMATS.clear()
    wire.FORMATS.update(saved)


def _step(compression, per_replica):
    """Two gradient all-reduces of 2 replicas' lists (`batch_reduce`) -> (the second's outputs,
    the variable set, its plan, the control bytes sent per step: sent bytes beyond the packs'
    wire buffers)."""
    gfar, strategy = make(2, compression=compression)
    out = batch_reduce(gfar, strategy, per_replica)
    (name, variable_set), = gfar.states().items()
    packs_bytes = sum(spec.num_bytes for spec in variable_set.pack_specs)
    control = gfar.stats.result()["sent_bytes_per_step"] - packs_bytes
    return out, variable_set, gfar.plans()[name].plan, control


def _grads(dtypes):
    return [[(RNG.normal(size=s) * 1e-3).astype(d) for s, d in zip(SHAPES, dtypes)]
            for _ in range(2)]


def _assert_sums(out, per_replica):
    """Every replica's result within bfloat16's precision of the float64 sum of the inputs."""
    for k, results in enumerate(out):
        want = sum(np.asarray(r[k], np.float64) for r in per_replica)
        for got in results:
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -6,
                                       atol=2 ** -6 * np.abs(want).max())


def test_bf16_packs_and_native_bfloat16_gradients_stay_unscaled_beside_bf16_scaled(bf16_scaled):
    per_replica = _grads([np.float32, BF16, np.float32])
    out, variable_set, plan, control = _step("bf16", per_replica)
    formats = {spec.dtypes[0]: spec.wire for spec in variable_set.pack_specs}
    assert formats == {tf.float32: wire.FORMATS["bf16"], tf.bfloat16: wire.BF16}
    assert not plan.scaled and not any(f.scaled for f in formats.values())
    assert control == 0                      # no scale bounds sent
    _assert_sums(out, per_replica)


def test_native_bfloat16_gradients_stay_unscaled_on_every_wire(bf16_scaled):
    per_replica = _grads([BF16] * 3)
    for compression in (None, "fp16", "bf16_scaled"):
        out, variable_set, _, control = _step(compression, per_replica)
        assert [spec.wire for spec in variable_set.pack_specs] == [wire.BF16]
        assert control == 0
        _assert_sums(out, per_replica)


def test_bf16_scaled_packs_are_scaled(bf16_scaled):
    per_replica = _grads([np.float32] * 3)
    out, variable_set, plan, control = _step("bf16_scaled", per_replica)
    assert [spec.wire for spec in variable_set.pack_specs] == [bf16_scaled]
    assert plan.scaled
    # The bounds ride in the pack a step ahead, in its slots, and the first step's float32 retry.
    elements = sum(int(np.prod(s)) for s in SHAPES)
    assert control == fp16_pack_bytes(elements, len(SHAPES), 0.5) - 2 * elements
    _assert_sums(out, per_replica)


def test_the_dense_reducer_sends_no_control_collective_and_none_is_priced(bf16_scaled):
    """With every latency unit 1 s and nothing else costing, one pack over the 2-worker ring
    is predicted at 2 s (two hops) on every format, as the dense reducer prices it (no control
    collective, `Reducer.wire_control`); 2 s more for a reducer with a control collective on a
    scaled format. The dense reducer's scaled packs carry their bounds as slots instead."""
    costs = Costs(0.0, {name: 1.0 for name in collectives.ALGORITHMS},
                  {f.method: 0.0 for f in wire.FORMATS.values()})
    per_replica = _grads([np.float32] * 3)
    elements = sum(int(np.prod(s)) for s in SHAPES)
    for name, wire_format in list(wire.FORMATS.items()):
        _, variable_set, plan, control = _step(name, per_replica)
        assert [spec.wire for spec in variable_set.pack_specs] == [wire_format]
        dense = planner.predict_seconds(plan.method, collectives.RING, elements, len(SHAPES), 2,
                                        costs, packs=1, control=False)
        with_control = planner.predict_seconds(plan.method, collectives.RING, elements,
                                               len(SHAPES), 2, costs, packs=1)
        assert dense == 2.0, name
        assert with_control == (4.0 if wire_format.scaled else 2.0), name
        slots = (fp16_pack_bytes(elements, len(SHAPES), 0.5) - 2 * elements
                 if wire_format.scaled else 0)
        assert control == slots, name


def test_csc_sends_packs_of_two_formats_of_one_dtype_in_separate_chunk_all_reduces(bf16_scaled):
    """A float32 pack on bf16_scaled and a native bfloat16 pack on bf16 share a dtype but not
    "is this scaled?": CSC's chunk exchange groups them apart, so each buffer has one scale rule."""
    from gf_tf import packing
    from gf_tf.csc import selection
    signature = [((64,), tf.float32), ((32,), tf.bfloat16), ((16,), tf.float32)]
    specs = packing.plan_packs(signature, 0, bf16_scaled)
    by_dtype = {spec.dtypes[0]: spec for spec in specs}
    assert by_dtype[tf.float32].wire is bf16_scaled and by_dtype[tf.bfloat16].wire == wire.BF16
    assert {spec.wire_dtype for spec in specs} == {tf.bfloat16}
    groups = selection.wire_groups(specs)
    assert len(groups) == 2
    for members in groups:
        assert len({specs[j].wire.scaled for j in members}) == 1
