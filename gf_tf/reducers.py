"""Reducers: how one pack of gradients is all-reduced (dense here; CSC in `gf_tf.sparsity`).

The shape is that of PyTorch DDP communication hooks: a small object that
takes a pack (bucket) and an explicit state, and returns the reduced tensors
and what it sent. A step runs in two phases, so that the small side
information of every pack (FP16 scale bounds, CSC chunk norms) travels in ONE
float32 all-reduce per step:

  1. `control`: per pack, per served replica, a local float32 vector of
     `control_size(pack)` elements (may be 0), plus anything the pack needs
     later (`carry`); and once per step `step_control` (`step_control_size`
     elements, usually 0: CSC density="auto" adds its timing figures).
     GradientFlowAllReduce concatenates the step's and every pack's vectors
     and all-reduces them (SUM) in one collective.
  2. `reduce`: per pack, with its all-reduced control vector: the pack's
     collective and the reduced tensors (`reduce_packs` may fuse the packs'
     collectives: CSC sends all its chunks in one, and gets the all-reduced
     step control).

Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and mixed-precision
communication; PyTorch DDP communication hooks for the interface.
"""

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf import compression as compression_lib
from gf_tf import ops
from gf_tf.packing import PackSpec

# Per served replica: the pack's gradients, in pack order.
PackGrads = Sequence[Sequence[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class Communicator:
    """The collectives a reducer may use, for the replicas this call serves.

    all_reduce_sum: one 1-D tensor per served replica (float16, bfloat16 or
      float32) -> per served replica the SUM over all N replicas of all workers.
    num_replicas: N, replicas over all workers.
    mean: the caller asked for MEAN (divide the SUM by N).
    replicas: indices (among this worker's replicas) of the served replicas:
      all of them on the merge-call path, one on the replica-context path.
    """
    all_reduce_sum: Callable[[List[tf.Tensor]], List[tf.Tensor]]
    num_replicas: int
    mean: bool
    replicas: Tuple[int, ...]


@dataclasses.dataclass
class Sent:
    """What one step sent for some packs, per replica (every replica sends the same).

    dense_bytes: float32 dense all-reduce equivalent (4 bytes x elements).
    sent_bytes: bytes put into collectives (wire buffers plus control vectors).
    selected_chunks / total_chunks: CSC chunks sent / existing (0 for dense).
    residual_norm: L1 norm of the first served replica's CSC residual, or None.
    density: the CSC density of the step (1.0 on dense steps; density="auto":
      the rung chosen), or None (a dense reducer: everything sent).
    Fields may be Python numbers or scalar tensors; `+` adds them up (density:
    the first one given).
    """
    dense_bytes: Any = 0
    sent_bytes: Any = 0
    selected_chunks: Any = 0
    total_chunks: Any = 0
    residual_norm: Any = None
    density: Any = None

    def __add__(self, other: "Sent") -> "Sent":
        norms = [n for n in (self.residual_norm, other.residual_norm) if n is not None]
        return Sent(self.dense_bytes + other.dense_bytes, self.sent_bytes + other.sent_bytes,
                    self.selected_chunks + other.selected_chunks,
                    self.total_chunks + other.total_chunks,
                    sum(norms[1:], norms[0]) if norms else None,
                    self.density if self.density is not None else other.density)


class Reducer:
    """Interface of a pack reducer. Subclasses override what they need."""

    def create_state(self, pack: PackSpec, devices: Sequence[str]) -> Optional[tf.Module]:
        """The pack's state (variables on this worker's replica `devices`), or None."""
        return None

    def control_size(self, pack: PackSpec) -> int:
        """float32 elements this pack adds to the step's control all-reduce."""
        return 0

    def control(self, pack: PackSpec, grads: PackGrads, state, comm: Communicator
                ) -> Tuple[List[tf.Tensor], Any]:
        """(per served replica a float32 [control_size] vector, carry for `reduce`)."""
        return [tf.zeros([0], tf.float32) for _ in grads], None

    def step_control_size(self, packs: Sequence[PackSpec]) -> int:
        """float32 elements the step (all packs together) adds to the control all-reduce."""
        return 0

    def step_control(self, packs: Sequence[PackSpec], grads: Sequence[PackGrads], states,
                     comm: Communicator) -> List[tf.Tensor]:
        """Per served replica a float32 [step_control_size] vector (runs before `control`)."""
        return [tf.zeros([0], tf.float32) for _ in comm.replicas]

    def reduce(self, pack: PackSpec, grads: PackGrads, control: List[tf.Tensor], carry,
               state, comm: Communicator) -> Tuple[List[List[tf.Tensor]], Sent]:
        """(per served replica the reduced tensors of the pack, what was sent)."""
        raise NotImplementedError

    def reduce_packs(self, packs: Sequence[PackSpec], grads: Sequence[PackGrads], controls,
                     carries, states, comm: Communicator, step_control=None
                     ) -> Tuple[List, Sent]:
        """All packs of a step (lists, one entry per pack): per pack what `reduce` returns,
        and the total sent. step_control: per served replica the all-reduced step
        control vector, or None when `step_control_size` is 0. The default reduces
        pack by pack; a reducer that fuses the packs' collectives (CSC) overrides it."""
        outputs, sent = [], Sent()
        for args in zip(packs, grads, controls, carries, states):
            reduced, pack_sent = self.reduce(*args, comm)
            outputs.append(reduced)
            sent = sent + pack_sent
        return outputs, sent


class DenseReducer(Reducer):
    """Packs, scales into the wire dtype's range, all-reduces and unpacks (lazy all-reduce + FP16).

    For a float16 wire the control vector holds each tensor's max |g|; its
    all-reduced SUM picks a power-of-two scale per tensor
    (`compression.power_of_two_scale`), so no partial sum of the ring
    overflows and small gradients keep full FP16 precision at any N.
    """

    def control_size(self, pack):
        return len(pack.shapes) if compression_lib.needs_scaling(pack.wire_dtype) else 0

    def control(self, pack, grads, state, comm):
        if not self.control_size(pack):
            return super().control(pack, grads, state, comm)
        vectors = []
        for g in grads:
            with tf.device(g[0].device):
                vectors.append(ops.abs_max(g))
        return vectors, None

    def reduce(self, pack, grads, control, carry, state, comm):
        buffers, postscales = [], []
        for g, bound in zip(grads, control):
            with tf.device(g[0].device):
                prescale, postscale = _scales(pack, bound, comm)
                buffers.append(ops.pack(g, pack.wire_dtype, prescale))
                postscales.append(postscale)
        buffers = comm.all_reduce_sum(buffers)
        outputs = []
        for g, buffer, postscale in zip(grads, buffers, postscales):
            with tf.device(g[0].device):
                outputs.append(ops.unpack(buffer, pack.shapes, pack.dtypes, postscale))
        sent = Sent(dense_bytes=4 * pack.num_elements,
                    sent_bytes=pack.num_bytes + 4 * self.control_size(pack))
        return outputs, sent


def _scales(pack: PackSpec, bound: tf.Tensor, comm: Communicator):
    """(prescale, postscale) of a dense pack: per tensor on a scaled wire, else scalars."""
    mean = 1.0 / comm.num_replicas if comm.mean else 1.0
    if not compression_lib.needs_scaling(pack.wire_dtype):
        return 1.0, mean
    prescale = compression_lib.power_of_two_scale(bound)
    return prescale, mean / prescale
