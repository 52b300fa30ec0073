"""The dense reducer: every pack packed, scaled into its wire's range, all-reduced and unpacked.

Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and mixed-precision communication.
"""

from typing import List

import tensorflow as tf

from gf_tf import ops
from gf_tf.packing import PackSpec
from gf_tf.reducers.base import (Communicator, PackStep, Reducer, Sent, for_each_group,
                                 fuse_controls, no_control, wire_scales)


class DenseReducer(Reducer):
    """Packs, scales into the wire dtype's range, all-reduces and unpacks (lazy all-reduce + FP16).

    For a float16 wire the control vector holds each tensor's max |g|; its
    all-reduced SUM picks a power-of-two scale per tensor
    (`wire.power_of_two_scale`), so no partial sum of the ring
    overflows and small gradients keep full FP16 precision at any N.
    With `step.groups` > 1 each group of packs (`for_each_group`) all-reduces its
    own bounds, then its packs, under the name scope "gf_group<g>" (`gf_tf.reducers.base`
    docstring: the order and why it cannot deadlock).
    """

    def reduce(self, step):
        comm = step.comm

        def group(g, packs):
            bounds = fuse_controls(comm, [self.bounds(pack, comm) for pack in packs])
            return [self.reduce_pack(pack.spec, pack.grads, bound, comm)
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
