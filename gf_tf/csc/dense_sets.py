"""Variable sets CSC never compresses travel as the dense reducer's FP16 packs.

A set is never compressed when every step CSC may run (the warm-up's stages and the density
rule's candidates: density="auto" sends at least `gf_tf.csc.density.MIN_CHUNKS` chunks of a
pack) sends every chunk of every pack, and no velocity is kept (momentum 0): mnist1d's CNN, one
pack of 8 chunks of 1024, is one. Chunk norms, the control all-reduce and the switch over plans
buy such a set nothing, so `CSCReducer` hands its packs to the dense reducer
(`gf_tf.reducers.dense`: FP16 packs scaled a step ahead, one collective a step). A residual a
checkpoint brought (one saved at a density that did compress the set) is added to the next
step's gradients and cleared, as a dense CSC step would send it. The set's CSC state keeps its
layout, so checkpoints restore across densities either way.
"""

import dataclasses
from typing import Sequence

import tensorflow as tf

from gf_tf import ops
from gf_tf.csc import selection
from gf_tf.packing import PackSpec
from gf_tf.reducers import PackStep, StepInput


def never_compressed(sparsity, specs: Sequence[PackSpec]) -> bool:
    """Whether no step of `sparsity` (a `ChunkSparsity`) sends fewer than every chunk of the
    packs `specs`, and it keeps no velocity."""
    if sparsity.momentum > 0.0 or not specs:
        return False
    size, rule = sparsity.chunk_size, sparsity.density_rule
    counts = [ops.num_chunks(spec.num_elements, size) for spec in specs]
    groups = selection.wire_groups(specs)
    return all(k is None
               for first, density in sparsity.candidates()
               for k in selection.plan_step(specs, counts, groups, size, sparsity.policy, first,
                                            density, 0, rule.min_chunks if first is None else 1).ks)


def reduce(step: StepInput, dense, chunk_size: int):
    """(per pack, per served replica the reduced tensors; what the step sent, as CSC counts
    a dense step: every chunk selected, density 1, the residual 0) through `dense` (a
    `gf_tf.reducers.DenseReducer`) for a set `never_compressed` said yes to."""
    comm = step.comm

    def with_residual(pack: PackStep) -> PackStep:
        def add(r, grads):
            parts = ops.unpack(pack.state.residuals[r].read_value(), pack.spec.shapes,
                               [tf.float32] * len(pack.spec.shapes))
            summed = [tf.cast(tf.cast(g, tf.float32) + part, g.dtype) for g, part in zip(grads, parts)]
            pack.state.residuals[r].assign(tf.zeros_like(pack.state.residuals[r]))
            return summed
        return PackStep(pack.spec, comm.map(add, pack.grads), pack.state, pack.hints)

    packs = tuple(with_residual(pack) for pack in step.packs)
    outputs, sent = dense.reduce(StepInput(packs, step.shared, comm, step.groups))
    with tf.device("/cpu:0"):
        for r in comm.replicas:
            step.shared.steps[r].assign_add(1)
        for pack in packs:
            pack.state.residual_l1.assign(0.0)
    chunks = sum(ops.num_chunks(pack.spec.num_elements, chunk_size) for pack in packs)
    return outputs, dataclasses.replace(sent, selected_chunks=chunks, total_chunks=chunks,
                                        residual_norm=0.0, density=1.0)
