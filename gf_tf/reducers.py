"""Reducers: how the packs of one step are all-reduced (dense here; CSC in `gf_tf.csc`).

The shape is that of PyTorch DDP communication hooks: a small object that
takes the step's packs (buckets) with their explicit state, and returns the
reduced tensors and what it sent. GradientFlowAllReduce hands a reducer ONE
record of the step (`StepInput`: the packs, each with its gradients per served
replica and its state, the set-level state and the `Communicator`) and gets
back per pack, per served replica, the reduced tensors.

The small side information of every pack (FP16 scale bounds, CSC chunk norms,
CSC density="auto" timing figures) travels in ONE float32 SUM all-reduce per
step: `fuse_controls`, which every reducer uses, concatenates the vectors,
all-reduces them once and splits them back. The dense reducer can instead cut
the packs into groups (`StepInput.groups`, `group_ranges`), each with its own
control all-reduce, so that a group's collectives depend only on its own
gradients and run while backprop computes the rest (overlap, issue 18).

Deadlock-freedom of the groups: every worker must issue the same collectives
in the same order. The groups are traced in pack order, and the packs and the
group count depend only on the pack plan and `Plan.groups`, which the settings
handshake compares (gf_tf.cross_device_ops `_settings`) before the first step.
TF's CollectiveAllReduce draws each collective's instance key at call time in
trace order (CollectiveReplicaLauncher._next_instance_key, a call-time capture
inside a tf.function), and gives every collective on a device its launcher's
ordering token, a resource, so automatic control dependencies chain them in
trace order: group g + 1's control all-reduce waits for group g's packs, never
the other way. gf_tf.collectives (recursive doubling) keeps this: one instance
key per all-reduce from the same launcher, its 2-member all-reduces on the
same token, its broadcasts chained by data within that all-reduce. Every edge
of the union over workers of these orders goes from an earlier (all-reduce,
stage) to a later one, so there is no cycle. Grouping changes no bound:
each tensor's scale comes from its own all-reduced max |g|, in whichever
group's vector it travels, so the sums are the same bits (beyond N = 2 the
ring may add a bound's float32 terms in another order, which moves its scale
only if the bound lands exactly on a power of two).

Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and mixed-precision
communication; PyTorch DDP communication hooks for the interface; TF's
per-replica `CrossDeviceOps._all_reduce(value, replica_id)` for the
communicator that keeps the replica axis out of the algorithm.
"""

import dataclasses
import zlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf import compression as compression_lib
from gf_tf import ops
from gf_tf.agreement import Setting, hex_text
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
    devices: per served replica, its device (where its per-replica work runs).
    """
    all_reduce_sum: Callable[[List[tf.Tensor]], List[tf.Tensor]]
    num_replicas: int
    mean: bool
    replicas: Tuple[int, ...]
    devices: Tuple[str, ...]

    @property
    def postscale(self) -> float:
        """What a SUM is multiplied by: 1/N for MEAN, else 1."""
        return 1.0 / self.num_replicas if self.mean else 1.0

    def map(self, fn: Callable, *columns: Sequence) -> list:
        """[fn(r, column_0[i], column_1[i], ...) on served replica i's device, per served
        replica i], r its index among this worker's replicas (for its state)."""
        out = []
        for i, (r, device) in enumerate(zip(self.replicas, self.devices)):
            with tf.device(device):
                out.append(fn(r, *[column[i] for column in columns]))
        return out


@dataclasses.dataclass(frozen=True)
class PackStep:
    """One pack of a step: its spec, its gradients per served replica, its reducer state."""
    spec: PackSpec
    grads: PackGrads
    state: Optional[tf.Module]


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step of one variable set, for `Reducer.reduce`.

    packs: the packs with elements, in all-reduce order.
    shared: the reducer's state of the whole set (`Reducer.create_states`), or None.
    comm: the collectives and the served replicas.
    groups: how many consecutive groups the packs are cut into (`group_ranges`),
      each with its own control all-reduce (1: one for the step). The dense
      reducer uses it; CSC keeps one.
    """
    packs: Tuple[PackStep, ...]
    shared: Optional[tf.Module]
    comm: Communicator
    groups: int = 1


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


# Per pack, per served replica, the reduced tensors of the pack (in pack order).
Reduced = List[List[List[tf.Tensor]]]


class Reducer:
    """Interface of a reducer: state, handshake settings, and the step."""

    def create_states(self, packs: Sequence[PackSpec], devices: Sequence[str]
                      ) -> Tuple[Optional[tf.Module], List[Optional[tf.Module]]]:
        """(the set's state or None, per pack its state or None), as variables on this
        worker's replica `devices`. Created eagerly, once per variable set."""
        return None, [None] * len(packs)

    def handshake_settings(self) -> List[Setting]:
        """(name, number, how to print it) that every worker must agree on, beyond the
        pack plan; the same names and count for every reducer (the handshake has a fixed
        width). Default: no sparsity."""
        return sparsity_settings(0.0, None)

    def reduce(self, step: StepInput) -> Tuple[Reduced, Sent]:
        """(per pack, per served replica the reduced tensors; what the step sent)."""
        raise NotImplementedError


def sparsity_settings(density, config) -> List[Setting]:
    """The handshake's two sparsity columns: the density (-1 for "auto", 0 without
    sparsity) and a CRC32 of `config` (any repr-able value; None: 0)."""
    code = -1.0 if density == "auto" else float(density)
    fingerprint = 0 if config is None else zlib.crc32(repr(config).encode())
    return [("sparsity density", code, density_text),
            ("sparsity settings (CRC32)", fingerprint, hex_text)]


def density_text(code) -> str:
    """How the handshake prints a density code: "auto" for -1, else the fraction."""
    return "auto" if code < 0 else f"{code:g}"


def fuse_controls(comm: Communicator, parts: Sequence[Sequence[tf.Tensor]]
                  ) -> List[List[tf.Tensor]]:
    """Every part's control vector in ONE float32 SUM all-reduce.

    Args:
      parts: per part (the step, a pack, ...), per served replica a float32
        [size] vector, the size static and equal on every replica (may be 0).

    Returns:
      per part, per served replica its all-reduced vector (the parts as given,
      without any collective, when every size is 0).
    """
    sizes = [int(part[0].shape[0]) for part in parts]
    if not sum(sizes):
        return [list(part) for part in parts]
    summed = comm.all_reduce_sum([tf.concat([part[i] for part, size in zip(parts, sizes) if size],
                                            0) for i in range(len(comm.replicas))])
    split = [tf.split(s, sizes) for s in summed]
    return [[split[i][j] for i in range(len(comm.replicas))] for j in range(len(parts))]


def group_ranges(count: int, groups: int) -> List[Tuple[int, int]]:
    """[start, end) of each of `groups` consecutive groups of `count` packs, in order, as
    equal in pack count as they can be (group g: floor(g count / G) .. floor((g+1) count / G));
    G = groups clipped to 1 .. count (no empty group). Pure: equal on every worker."""
    groups = max(1, min(int(groups), count))
    return [(g * count // groups, (g + 1) * count // groups) for g in range(groups)]


def no_control(comm: Communicator) -> List[tf.Tensor]:
    """Per served replica an empty control vector (float32 [0])."""
    return [tf.zeros([0], tf.float32) for _ in comm.replicas]


def wire_scales(wire_dtype: tf.DType, comm: Communicator, bound: Callable[[], tf.Tensor]):
    """(prescale, postscale) onto and off a wire: powers of two from the all-reduced
    magnitude `bound()` on a scaled wire (gf_tf.compression), else (1, the postscale)."""
    if not compression_lib.needs_scaling(wire_dtype):
        return 1.0, comm.postscale
    prescale = compression_lib.power_of_two_scale(bound())
    return prescale, comm.postscale / prescale


class DenseReducer(Reducer):
    """Packs, scales into the wire dtype's range, all-reduces and unpacks (lazy all-reduce + FP16).

    For a float16 wire the control vector holds each tensor's max |g|; its
    all-reduced SUM picks a power-of-two scale per tensor
    (`compression.power_of_two_scale`), so no partial sum of the ring
    overflows and small gradients keep full FP16 precision at any N.
    With `step.groups` > 1 each group of packs (`group_ranges`) all-reduces its
    own bounds, then its packs, under the name scope "gf_group<g>" (module
    docstring: the order and why it cannot deadlock).
    """

    def reduce(self, step):
        comm = step.comm
        outputs, sent = [], Sent()
        ranges = group_ranges(len(step.packs), step.groups)
        for g, (start, end) in enumerate(ranges):
            packs = step.packs[start:end]
            with tf.name_scope(f"gf_group{g}"):
                bounds = fuse_controls(comm, [self._bounds(pack, comm) for pack in packs])
                for pack, bound in zip(packs, bounds):
                    reduced, pack_sent = self._reduce_pack(pack.spec, pack.grads, bound, comm)
                    outputs.append(reduced)
                    sent = sent + pack_sent
        return outputs, sent

    @staticmethod
    def _bounds(pack: PackStep, comm: Communicator) -> List[tf.Tensor]:
        """Per served replica float32 [tensors]: each tensor's max |g| (scaled wires only)."""
        if not compression_lib.needs_scaling(pack.spec.wire_dtype):
            return no_control(comm)
        return comm.map(lambda r, g: ops.abs_max(g), pack.grads)

    @staticmethod
    def _reduce_pack(spec: PackSpec, grads, bounds, comm: Communicator):
        def to_wire(r, g, bound):
            prescale, postscale = wire_scales(spec.wire_dtype, comm, lambda: bound)
            return ops.pack(g, spec.wire_dtype, prescale), postscale
        buffers, postscales = zip(*comm.map(to_wire, grads, bounds))
        buffers = comm.all_reduce_sum(list(buffers))
        outputs = comm.map(lambda r, buffer, postscale: ops.unpack(
            buffer, spec.shapes, spec.dtypes, postscale), buffers, postscales)
        control_bytes = 4 * len(spec.shapes) if compression_lib.needs_scaling(spec.wire_dtype) else 0
        return outputs, Sent(dense_bytes=4 * spec.num_elements,
                             sent_bytes=spec.num_bytes + control_bytes)
