"""The dense reducer: every pack packed, scaled into its wire's range, all-reduced and unpacked.

A float32 pack on a scaled wire (FP16) is scaled a step ahead: its prescale comes from the
previous step's all-reduced bound (`ScaleAhead`), so the pack is the step's only collective.
The bound of this step rides in the same buffer, as `wire.ahead_slots(T)` slots after the
T tensors' values: each worker's own max |g| times the prescale, 1 where that max is not 0, 1
where the worker has no previous bound, and each bit b of a hash of its previous bounds as b and
1 - b. Their sums come out of the all-reduce as the same bits on every worker, so every worker
takes the same decision: the values are kept, or, where the summed bound is not finite, grew
past 2**15 (a partial sum could have overflowed), or shrank more than `wire.AHEAD_SHRINK_BITS`
below its room (small values would lose precision), or a worker had no bound (the first step, a
reset), or the workers' bounds differ (some worker counted a hash bit 1 and some 0: they scaled
by other powers of two, as a checkpoint restored from other steps would make them), the pack is
sent again in float32 with its exact bounds (one more collective, counted as the figure
"float32_retries").

Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and mixed-precision communication;
the one-step-ahead scale is the delayed scaling of FP8 training recipes (NVIDIA Transformer
Engine: the scale of step t from the amax history of earlier steps).
"""

from typing import List, Optional, Sequence

import tensorflow as tf

from gf_tf import ops, wire
from gf_tf.packing import PackSpec
from gf_tf.reducers.base import (Communicator, PackStep, Reducer, Sent, for_each_group,
                                 fuse_controls, local_variable, no_control, wire_scales)


class ScaleAhead:
    """The previous step's all-reduced bounds of one pack, per local replica.

    Attributes:
      bounds: per local replica of this worker, float32 [T] (T: the pack's tensors): the SUM
        over workers of each tensor's max |g| at the pack's previous step; NaN before the first
        step. The same on every worker (it comes out of the all-reduce). A hint only: a wrong
        or missing bound costs a float32 retry, never a value; checkpoints keep it beside the
        reducer's state (`gf_tf.keras.checkpoint`), and one without it starts with a retry.
    """

    def __init__(self, spec: PackSpec, devices: Sequence[str]):
        unknown = tf.fill([len(spec.shapes)], float("nan"))
        self.bounds = [local_variable(unknown, d, f"gf_scale_ahead_{spec.key}_r{r}")
                       for r, d in enumerate(devices)]

    def named_variables(self):
        """{"bound_r<r>": the bounds of local replica r}: what a checkpoint keeps of it, so that
        a resumed run scales its next step as the uninterrupted one would."""
        return {f"bound_r{r}": v for r, v in enumerate(self.bounds)}


_HASH_PRIME = 2 ** 31 - 1


def agreement_bits(bounds: tf.Tensor) -> tf.Tensor:
    """float32 [wire.AGREEMENT_BITS] of 0 and 1: the low bits of sum_t bits(bounds[t]) * m_t mod
    2**31 - 1 (m_t = 48271 (t + 1) mod 2**31 - 1, t over the T tensors), exact in int64; equal
    bounds give equal bits, bounds that differ in any tensor almost never do."""
    words = tf.cast(tf.bitcast(bounds, tf.uint32), tf.int64)
    multipliers = (tf.range(1, tf.size(bounds, tf.int64) + 1) * 48271) % _HASH_PRIME
    digest = tf.reduce_sum(words * multipliers % _HASH_PRIME) % _HASH_PRIME
    shifts = tf.range(wire.AGREEMENT_BITS, dtype=tf.int64)
    return tf.cast(tf.bitwise.right_shift(digest, shifts) % 2, tf.float32)


def scales_ahead(spec: PackSpec) -> bool:
    """Whether the dense reducer scales this pack a step ahead: float32 values on a scaled wire."""
    return spec.wire.scaled and all(d == tf.float32 for d in spec.dtypes)


class DenseReducer(Reducer):
    """Packs, scales into the wire dtype's range, all-reduces and unpacks (lazy all-reduce + FP16).

    A float32 pack on a float16 wire is scaled a step ahead (module docstring): one collective
    a step, with a float32 retry where the previous step's bound does not fit. Other scaled
    packs (float16 gradients) send each tensor's max |g| first: its all-reduced SUM picks a
    power-of-two scale per tensor (`wire.power_of_two_scale`), so no partial sum of the ring
    overflows and small gradients keep full FP16 precision at any N.
    With `step.groups` > 1 each group of packs (`for_each_group`) all-reduces its
    own bounds, then its packs, under the name scope "gf_group<g>" (`gf_tf.reducers.base`
    docstring: the order and why it cannot deadlock).
    """

    wire_control = False

    def create_hints(self, packs: Sequence[PackSpec], devices: Sequence[str]
                     ) -> List[Optional[ScaleAhead]]:
        return [ScaleAhead(spec, devices) if scales_ahead(spec) else None for spec in packs]

    def reduce(self, step):
        comm = step.comm

        def group(g, packs):
            bounds = fuse_controls(comm, [no_control(comm) if pack.hints is not None
                                          else self.bounds(pack, comm) for pack in packs])
            return [reduce_ahead(pack, comm) if pack.hints is not None
                    else self.reduce_pack(pack.spec, pack.grads, bound, comm)
                    for pack, bound in zip(packs, bounds)]

        results = [result for part in for_each_group(step, group) for result in part]
        return [outputs for outputs, _ in results], sum((s for _, s in results), Sent())

    @staticmethod
    def bounds(pack: PackStep, comm: Communicator) -> List[tf.Tensor]:
        """Per served replica float32 [tensors]: each tensor's max |g| on a scaled wire, else
        float32 [0] (the pack's part of the control all-reduce, `fuse_controls`)."""
        if not pack.spec.wire.scaled:
            return no_control(comm)
        return comm.map(lambda r, g: ops.abs_max(g), pack.grads)

    @staticmethod
    def reduce_pack(spec: PackSpec, grads, bounds, comm: Communicator):
        """One pack's all-reduce: (per served replica its reduced tensors, in pack order; what
        it sent). bounds: per served replica the all-reduced `bounds` (float32 [tensors] or [0])."""
        def to_wire(r, g, bound):
            prescale, postscale = wire_scales(spec.wire, comm, lambda: bound)
            return ops.pack(g, spec.wire_dtype, prescale), postscale
        buffers, postscales = zip(*comm.map(to_wire, grads, bounds))
        buffers = comm.all_reduce_sum(list(buffers))
        outputs = comm.map(lambda r, buffer, postscale: ops.unpack(
            buffer, spec.shapes, spec.dtypes, postscale), buffers, postscales)
        control_bytes = 4 * len(spec.shapes) if spec.wire.scaled else 0
        return outputs, Sent(dense_bytes=4 * spec.num_elements,
                             sent_bytes=spec.num_bytes + control_bytes)


def reduce_ahead(pack: PackStep, comm: Communicator):
    """One pack scaled a step ahead (module docstring): (per served replica its reduced tensors,
    in pack order; what it sent, with the figure "float32_retries": 1 on a retry, else 0)."""
    spec, count = pack.spec, len(pack.spec.shapes)
    extra = wire.ahead_slots(count)
    shapes, dtypes = list(spec.shapes) + [[extra]], list(spec.dtypes) + [tf.float32]

    def to_wire(r, grads):
        previous = pack.hints.bounds[r].read_value()
        prescale = wire.ahead_scale(previous)
        own = ops.abs_max(grads)
        unknown = tf.cast(tf.reduce_any(~tf.math.is_finite(previous)), tf.float32)
        bits = agreement_bits(previous)
        slots = tf.concat([own * prescale, tf.cast(own > 0, tf.float32), [unknown], bits,
                           1.0 - bits], 0)
        buffer = ops.pack(list(grads) + [slots], spec.wire_dtype, tf.concat([prescale, [1.0]], 0))
        return buffer, prescale, own

    buffers, prescales, owns = zip(*comm.map(to_wire, pack.grads))
    buffers = comm.all_reduce_sum(list(buffers))
    with tf.device(comm.devices[0]):
        slots = tf.cast(buffers[0][spec.num_elements:], tf.float32)
        summed, nonzero = slots[:count], slots[count:2 * count]
        unknown, bits = slots[2 * count], wire.AGREEMENT_BITS
        ones, zeros = slots[2 * count + 1:2 * count + 1 + bits], slots[2 * count + 1 + bits:]
        disagree = tf.reduce_any((ones > 0) & (zeros > 0))
        retry = ~tf.reduce_all(wire.ahead_fits(summed, nonzero)) | (unknown > 0) | disagree

    def keep():
        def unpack(r, buffer, prescale):
            postscale = tf.concat([comm.postscale / prescale, [1.0]], 0)
            *tensors, reduced_slots = ops.unpack(buffer, shapes, dtypes, postscale)
            return tensors + [reduced_slots[:count] / prescale]
        return comm.map(unpack, buffers, prescales)

    def resend():   # float32, with each tensor's exact max |g| (unscaled) as the slots
        exact = comm.all_reduce_sum(comm.map(
            lambda r, grads, own: ops.pack(list(grads) + [own], tf.float32), pack.grads, owns))
        postscale = [comm.postscale] * count + [1.0]
        return comm.map(lambda r, buffer: ops.unpack(
            buffer, spec.shapes + (tf.TensorShape([count]),), dtypes, postscale), exact)

    results = tf.cond(retry, resend, keep)
    outputs = []
    for i, r in enumerate(comm.replicas):
        *tensors, bound = results[i]
        with tf.device(comm.devices[i]):
            pack.hints.bounds[r].assign(bound)
        outputs.append(tensors)
    retried = tf.cast(retry, tf.int64)
    wire_bytes = spec.num_bytes + spec.wire_dtype.size * extra
    return outputs, Sent(dense_bytes=4 * spec.num_elements,
                         sent_bytes=wire_bytes + retried * 4 * (spec.num_elements + count),
                         figures={"float32_retries": retried})
