"""The reducer seam: how the packs of one step are all-reduced (dense: `dense`; CSC: `gf_tf.csc`).

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
the packs into groups (`StepInput.groups`, `for_each_group`), each with its own
control all-reduce, so that a group's collectives depend only on its own
gradients and run while backprop computes the rest (overlap).

Deadlock-freedom of the groups: every worker must issue the same collectives
in the same order. The groups are traced in pack order, and the packs and the
group count depend only on the pack plan and `Plan.groups`, which the settings
handshake compares (`gf_tf.route`) before the first step.
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf import tf_internal, wire
from gf_tf.agreement import Setting
from gf_tf.packing import PackSpec

# Per served replica: the pack's gradients, in pack order.
PackGrads = Sequence[Sequence[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class Communicator:
    """The collectives a reducer may use, for the replicas this call serves.

    Attributes:
      all_reduce_sum: one 1-D tensor per served replica (float16, bfloat16 or
        float32, the same shape on every replica) -> per served replica the SUM over
        all N replicas of all workers, same shape and dtype.
      num_replicas: N, replicas over all workers.
      mean: the caller asked for MEAN (divide the SUM by N).
      replicas: indices (among this worker's replicas) of the served replicas:
        all of them on the merge-call path, one on the replica-context path.
      devices: per served replica, its device (where its per-replica work runs).
      latency_bytes: bytes one all_reduce_sum could carry in its latency term
        (`gf_tf.plan.latency_bytes` of the planner's measured costs; 0.0: not measured).
    """
    all_reduce_sum: Callable[[List[tf.Tensor]], List[tf.Tensor]]
    num_replicas: int
    mean: bool
    replicas: Tuple[int, ...]
    devices: Tuple[str, ...]
    latency_bytes: float = 0.0

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
    """One pack of a step.

    Attributes:
      spec: the pack's `gf_tf.packing.PackSpec` (its tensors' shapes and dtypes).
      grads: per served replica, the pack's gradients in pack order.
      state: the pack's reducer state (`Reducer.create_states`), or None.
      hints: what the reducer keeps of the pack that is not state (`Reducer.create_hints`:
        a wrong or missing one costs time, never a value), or None.
    """
    spec: PackSpec
    grads: PackGrads
    state: Optional[tf.Module]
    hints: Any = None


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step of one variable set, for `Reducer.reduce`.

    Attributes:
      packs: the packs with elements, in all-reduce order.
      shared: the reducer's state of the whole set (`Reducer.create_states`), or None.
      comm: the collectives and the served replicas.
      groups: how many consecutive groups the packs are cut into (`group_ranges`),
        each with its own control all-reduce (1: one for the step). The dense
        reducer uses it, and so does CSC where its `CostTerms.groupable` is true
        (per-pack or "ahead" selection at a fixed density).
    """
    packs: Tuple[PackStep, ...]
    shared: Optional[tf.Module]
    comm: Communicator
    groups: int = 1


@dataclasses.dataclass
class Sent:
    """What one step sent for some packs, per replica (every replica sends the same).

    Fields may be Python numbers or scalar tensors; `+` adds them up (density:
    the first one given).

    Attributes:
      dense_bytes: float32 dense all-reduce equivalent, in bytes (4 bytes x elements).
      sent_bytes: bytes put into collectives (wire buffers plus control vectors).
      figures: the reducer's own figures of the step by name (lower case letters, digits
        and "_"; Python numbers or scalar tensors), summed over packs by `+`. CommStats
        totals each as "figure_<name>" and reports its mean per step as "<name>_per_step",
        which GradientFlowStats logs, without knowing the reducer.
      selected_chunks: CSC chunks sent (0 for dense).
      total_chunks: CSC chunks existing (0 for dense).
      residual_norm: L1 norm of the first served replica's CSC residual, or None.
      density: the CSC density of the step (1.0 on dense steps; density="auto":
        the rung chosen), or None (a dense reducer: everything sent).
    """
    dense_bytes: Any = 0
    sent_bytes: Any = 0
    selected_chunks: Any = 0
    total_chunks: Any = 0
    residual_norm: Any = None
    density: Any = None
    figures: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __add__(self, other: "Sent") -> "Sent":
        norms = [n for n in (self.residual_norm, other.residual_norm) if n is not None]
        figures = dict(self.figures)
        for name, value in other.figures.items():
            figures[name] = figures[name] + value if name in figures else value
        return Sent(self.dense_bytes + other.dense_bytes, self.sent_bytes + other.sent_bytes,
                    self.selected_chunks + other.selected_chunks,
                    self.total_chunks + other.total_chunks,
                    sum(norms[1:], norms[0]) if norms else None,
                    self.density if self.density is not None else other.density, figures)


# Per pack, per served replica, the reduced tensors of the pack (in pack order).
Reduced = List[List[List[tf.Tensor]]]


# Settings a reducer may declare for the handshake: the handshake has a fixed width (one
# collective that cannot itself mismatch), so every reducer's settings are padded to this.
MAX_REDUCER_SETTINGS = 5


@dataclasses.dataclass(frozen=True)
class CostTerms:
    """What one step of a reducer costs on the wire, for the planner (`gf_tf.plan.planner`).

    Attributes:
      collective_bytes: bytes per worker of each collective a step issues, in order
        (for the whole set; cut into groups, each group issues the same collectives
        over its share).
      groupable: the packs may be cut into groups, each issuing its own collectives,
        so a group waits only for its own gradients (overlap with backprop).
    """
    collective_bytes: Tuple[int, ...]
    groupable: bool = False


class Reducer:
    """The interface of a reducer: its state, settings, cost and step.

    Subclass it and pass an instance as `GradientFlowAllReduce(reducer=...)`. The
    shape is that of PyTorch DDP communication hooks (`gf_tf.reducers.base`).

    Attributes:
      default_method: the wire a reducer's packs travel by with compression="auto":
        "auto" (for a reducer without its own `cost`: the planner chooses among the
        wire formats and TF's own all-reduce; with one: the packs' own dtype) or a
        wire format's method name (`gf_tf.wire`).
    """

    default_method = "auto"
    # Its packs on a scaled wire need their all-reduced bounds first (one control collective
    # a step, as the planner's model of packs prices it): False for the dense reducer, which
    # scales a step ahead.
    wire_control = True

    def create_states(self, packs: Sequence[PackSpec], devices: Sequence[str]
                      ) -> Tuple[Optional[tf.Module], List[Optional[tf.Module]]]:
        """(the set's state or None, per pack its state or None), as variables on this
        worker's replica `devices`. Created eagerly, once per variable set. A state
        object serializes itself (`to_arrays`, `to_tensors`, `assign_arrays`)."""
        return None, [None] * len(packs)

    def create_hints(self, packs: Sequence[PackSpec], devices: Sequence[str]) -> List[Any]:
        """Per pack what the reducer keeps that is not state (`PackStep.hints`: variables on
        this worker's replica `devices`, equal on every worker, a wrong or missing one costing
        time, never a value), or None. Created eagerly, once per variable set. An object with
        `named_variables()` ({key: tf.Variable}) is saved in checkpoints and restored where its
        key and shape match; nothing checks it. Default: none."""
        return [None] * len(packs)

    def settings(self) -> List[Setting]:
        """(name, number, how to print it) that every worker must agree on beyond the pack
        plan, at most MAX_REDUCER_SETTINGS of them. Default: none."""
        return []

    def state_settings(self) -> List[Setting]:
        """(name, number, how to print it) of the settings the state's layout and meaning
        depend on: a checkpoint's state restores into a reducer of the same class whose state
        settings equal the saved ones (`gf_tf.keras.checkpoint`); settings left out (CSC's
        density) may change across a restore. Default: `settings()`."""
        return self.settings()

    def cost(self, elements: int, wire_format: wire.WireFormat) -> Optional[CostTerms]:
        """The wire cost of one step over `elements` float32 gradient elements whose packs
        travel on `wire_format` (`gf_tf.wire.WireFormat`: the pinned compression's, or under
        "auto" the `default_method`'s, "auto" itself giving the None format), or None:
        the planner's model of packs (wire format, pack size, scale bounds, overlap groups),
        as for the dense reducer."""
        return None

    def reduce(self, step: StepInput) -> Tuple[Reduced, Sent]:
        """(per pack, per served replica the reduced tensors; what the step sent)."""
        raise NotImplementedError


def local_variable(initial_value: Any, device: str, name: str) -> tf.Variable:
    """A variable for a reducer's state: plain, non-trainable, on `device`, even when created
    inside `strategy.scope()` (where `tf.Variable` would become a MirroredVariable, and Keras
    enters that scope around `fit`).

    Args:
      initial_value: a tensor or array of any dtype and shape (the variable's).
      device: the replica's device, as `create_states` receives it ("/job:worker/.../CPU:0").
      name: the variable's name (for TensorBoard and error messages only; the checkpoint
        keys come from the state's `named_variables` or `to_arrays`).

    Returns:
      a resource variable, never in the model's weights: a reducer's state reaches the
      checkpoint through its `VariablesState.named_variables` (or `to_arrays`). TensorFlow's
      own cross-device ops create their helper variables the same way.
    """
    return tf_internal.local_variable(initial_value, device, name)


class VariablesState(tf.Module):
    """Reducer state that saves its variables as they are: a subclass gives `named_variables()`
    (its tf.Variables by array key) and gets the serialization the checkpoint reads."""

    def named_variables(self) -> Dict[str, tf.Variable]:
        """Every saved variable by its array key."""
        raise NotImplementedError

    def to_arrays(self) -> Dict[str, Any]:
        """The variables' values as NumPy arrays by key (eager)."""
        return {key: v.numpy() for key, v in self.named_variables().items()}

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """`to_arrays` as tensors read from the variables (eager or in a graph)."""
        return {key: v.read_value() for key, v in self.named_variables().items()}

    def assign_arrays(self, arrays: Dict[str, Any]) -> None:
        """Assigns what `to_arrays` gave (keys and shapes checked by the caller)."""
        for key, v in self.named_variables().items():
            v.assign(arrays[key])


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


def for_each_group(step: StepInput, fn: Callable[[int, Tuple[PackStep, ...]], Any]) -> list:
    """[fn(g, the packs of group g)] for the `step.groups` consecutive groups of the step's
    packs (`group_ranges`), in order, each under the name scope `gf_group<g>`."""
    out = []
    for g, (start, end) in enumerate(group_ranges(len(step.packs), step.groups)):
        with tf.name_scope(f"gf_group{g}"):
            out.append(fn(g, step.packs[start:end]))
    return out


def group_ranges(count: int, groups: int) -> List[Tuple[int, int]]:
    """[start, end) of each of `groups` consecutive groups of `count` packs, in order, as
    equal in pack count as they can be (group g: floor(g count / G) .. floor((g+1) count / G));
    G = groups clipped to 1 .. count (no empty group). Pure: equal on every worker."""
    groups = max(1, min(int(groups), count))
    return [(g * count // groups, (g + 1) * count // groups) for g in range(groups)]


def no_control(comm: Communicator) -> List[tf.Tensor]:
    """Per served replica an empty control vector (float32 [0])."""
    return [tf.zeros([0], tf.float32) for _ in comm.replicas]


def wire_scales(wire_format: wire.WireFormat, comm: Communicator,
                bound: Callable[[], tf.Tensor]):
    """(prescale, postscale) onto and off a wire: powers of two from the all-reduced
    magnitude `bound()` where `wire_format.scaled` (a `gf_tf.wire.WireFormat`, e.g. a
    `PackSpec.wire`), else (1, the postscale)."""
    if not wire_format.scaled:
        return 1.0, comm.postscale
    prescale = wire.power_of_two_scale(bound())
    return prescale, comm.postscale / prescale
