"""CSC selection: chunk counts, top-k, the selection policy interface and the plan of one step.

A `StepPlan` is computed once per candidate density of a trace (a schedule
stage or an auto rung): per pack its k, per wire group (the packs of one wire
dtype, one chunk all-reduce each) its static buffer length, and the bytes and
chunks the step sends. Wire shapes are static, so every plan is Python numbers.
"""

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf.csc.state import CSCState
from gf_tf.packing import PackSpec
from gf_tf.reducers import fuse_controls


def selected_chunk_count(num_chunks: int, density: float, at_least: int = 1) -> int:
    """k = max(at_least, ceil(density * num_chunks)), at most num_chunks.

    The product is rounded to 9 decimals first so that e.g. 0.07 * 100
    (7.000000000000001 in binary floating point) gives 7, not 8.
    Returns 0 for a pack of 0 chunks. at_least: >= 1 (density="auto"'s `min_chunks`).
    """
    if num_chunks <= 0:
        return 0
    return min(num_chunks, max(at_least, math.ceil(round(density * num_chunks, 9))))


def select_chunks(norms: tf.Tensor, k: int) -> tf.Tensor:
    """Indices of the `k` largest entries of `norms`, sorted ascending.

    Args:
      norms: float32 [C], identical on every replica (all-reduced).
      k: static number of chunks, 1 <= k <= C.

    Returns:
      int32 [k]. Equal norms go to the lower chunk index (tf.math.top_k is
      documented to put the lower index first among equal values); NaN ranks
      as +inf, so a non-finite chunk is always selected and visible in the
      output.
    """
    key = tf.where(tf.math.is_nan(norms), tf.constant(math.inf, norms.dtype), norms)
    _, indices = tf.math.top_k(key, k=k, sorted=True)
    return tf.sort(indices)


class SelectionPolicy:
    """A selection policy (`ChunkSparsity(selection=name)`): which chunks compete for the k
    places of a step, how they are chosen, what a step sends and the state it keeps.

    The built-in ones (`gf_tf.csc.per_pack`, `gf_tf.csc.global_top_k`, `gf_tf.csc.ahead`) and
    yours are registered in `gf_tf.csc.policies`. `CSCReducer` runs a step through these
    methods only; a policy that only changes which chunks of a pack are sent subclasses
    `PerPackSelection` and overrides `select`.

    Attributes:
      name (str): its `selection=` name.
      scorings (tuple of str): the `scoring=` values it accepts (none: only the default).
      carries_control (bool): every step all-reduces the chunk norms (a float32 control
        vector) before its chunks, so density="auto"'s timing can ride along.
      groupable (bool): groups of packs may each select and send on their own (overlap).
      figures (tuple of str): the names of its own per-step counts (`Sent.figures`, totalled
        by `CommStats`), which `step` returns as a fifth item.
    """
    name = ""
    scorings: Tuple[str, ...] = ()
    carries_control = True
    groupable = True
    figures: Tuple[str, ...] = ()

    def competing(self, counts: Sequence[int], members: Sequence[int]) -> List[int]:
        """Per member pack of a wire group, the chunk count its k is taken over."""
        raise NotImplementedError

    def group_top_k(self, ks, members) -> Optional[int]:
        """The K of one top K over the group's chunks, or None (each pack its own k)."""
        raise NotImplementedError

    def select(self, norms: tf.Tensor, k: int) -> tf.Tensor:
        """int32 [k], ascending: the chunks one pack sends, from its all-reduced chunk norms
        (float32 [C], the same on every replica); `select_chunks` (the top k)."""
        return select_chunks(norms, k)

    def wants_lookahead(self, sparsity) -> bool:
        """Whether its steps read `Accumulated.lookaheads` (ops.accumulate(lookahead=True)) when
        the packs keep a velocity: no."""
        del sparsity
        return False

    def create_state(self, name: str, num_elements: int, num_chunks: int, devices,
                     momentum: bool, steps) -> CSCState:
        """One pack's `CSCState` (residuals, and velocities with momentum)."""
        del num_chunks
        return CSCState(name, num_elements, devices, momentum, steps)

    def controls(self, comm, timing, accumulated):
        """(the all-reduced timing, per pack its all-reduced chunk norms): one fused float32
        all-reduce of the step's control vectors before any branch runs."""
        timing, *norms = fuse_controls(comm, [timing] + [a.norms for a in accumulated])
        return timing, norms

    def step(self, chunk_step, sparsity, step, counts, accumulated, norms, plan):
        """One group's step at `plan` (a StepPlan): `chunk_step(step, counts, accumulated, norms,
        plan)`, the reducer's chunk step of the group (`CSCReducer.chunk_step`), gives
        (outputs, residual_l1, started, done); a policy may return a fifth item, a dict of the
        step's counts by name (scalars; a name left out, or no fifth item, counts 0).
        `sparsity` is the `ChunkSparsity` the reducer serves."""
        del sparsity
        return chunk_step(step, counts, accumulated, norms, plan)

    def dense_updates(self, state: CSCState, replica: int, values, postscale, norms, comm,
                      chunk_size: int) -> tuple:
        """(variable, value) pairs a chunk step commits beyond residual and velocity: none."""
        del state, replica, values, postscale, norms, comm, chunk_size
        return ()

    def group_wire(self, counts: Sequence[int], length: int, density: float,
                   wire_bytes: int) -> Tuple[int, int]:
        """(elements of the group's chunk buffer, bytes one replica sends for the group) for a
        chunk buffer of `length` elements: the float32 norms of its `counts` chunks, then it."""
        del density
        return length, 4 * sum(counts) + length * wire_bytes

    def step_bytes(self, chunks: int, chunk_size: int, density: float,
                   wire_bytes: int) -> Tuple[int, ...]:
        """Bytes per worker of each collective of one sparse step over one pack of `chunks`
        chunks at `density`, `wire_bytes` bytes per wire element, for the planner: (chunk
        norms, selected chunks)."""
        return 4 * chunks, wire_bytes * chunk_size * selected_chunk_count(chunks, density)

    def config(self, sparsity) -> dict:
        """The settings of `sparsity` this policy adds to `get_config` (none)."""
        del sparsity
        return {}


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One wire group of a step: members (pack positions, in pack order), top_k (one top
    K over their chunks, or None: each pack's own k or all of its chunks) and length
    (static elements of the group's chunk buffer)."""
    members: Tuple[int, ...]
    top_k: Optional[int]
    length: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step sends at one candidate density.

    first_step: the schedule stage's first step, None for a density="auto" rung.
    density: the candidate density (1.0: dense).
    ks: per pack, the static chunk count of its selection (its k, or its group's K),
      or None: every chunk (a dense step of the pack).
    groups: per wire group its GroupPlan (selection="ahead", sparse: its length counts the
      scores and bound that ride behind the chunks, `gf_tf.csc.ahead`).
    sent_bytes, selected_chunks: what one replica sends (control vectors included)
      and the chunks it selects (a dense pack counts all of its chunks).
    """
    first_step: Optional[int]
    density: float
    ks: Tuple[Optional[int], ...]
    groups: Tuple[GroupPlan, ...]
    sent_bytes: int
    selected_chunks: int


def wire_groups(specs: Sequence[PackSpec]) -> Tuple[Tuple[int, ...], ...]:
    """Positions of `specs` grouped by wire format (one chunk all-reduce each), in pack order:
    a group's packs share one dtype and one answer to "is this scaled?"."""
    groups = {}
    for j, spec in enumerate(specs):
        groups.setdefault(spec.wire, []).append(j)
    return tuple(tuple(members) for members in groups.values())


def plan_step(specs: Sequence[PackSpec], counts: Sequence[int], groups, chunk_size: int,
              policy, first_step: Optional[int], density: float, control_bytes: int,
              at_least: int = 1) -> StepPlan:
    """The StepPlan of `density`. counts: per pack its chunks; groups: `wire_groups(specs)`;
    policy: a SelectionPolicy; control_bytes: the step's own control vector, in bytes;
    at_least: the fewest chunks a k may be (`selected_chunk_count`)."""
    ks: List[Optional[int]] = [None] * len(specs)
    for members in groups:
        for j, competing in zip(members, policy.competing(counts, members)):
            k = selected_chunk_count(competing, density, at_least)
            ks[j] = None if k >= competing else k
    plans, sent, selected = [], control_bytes, 0
    for members in groups:
        top_k = policy.group_top_k(ks, members)
        if top_k is not None:
            length, chunks = top_k * chunk_size, top_k
        else:
            length = sum(specs[j].num_elements if ks[j] is None else ks[j] * chunk_size
                         for j in members)
            chunks = sum(counts[j] if ks[j] is None else ks[j] for j in members)
        length, group_bytes = policy.group_wire([counts[j] for j in members], length, density,
                                                specs[members[0]].wire_dtype.size)
        sent += group_bytes
        selected += chunks
        plans.append(GroupPlan(members, top_k, length))
    return StepPlan(first_step, density, tuple(ks), tuple(plans), sent, selected)


def group_shares(counts: Sequence[int], norms: Sequence[Sequence[tf.Tensor]], k: int,
                 comm) -> List[List[tf.Tensor]]:
    """selection="global": per pack of one wire group, per served replica, its share of one top k.

    The all-reduced norms (per pack, per served replica; `counts` chunks each)
    are concatenated in pack order; `select_chunks` takes the k largest (ties:
    the lower index in that order; NaN first). Pack p's share: the selected
    indices in [offset_p, offset_p + C_p), minus offset_p: int32 [k_p],
    ascending, k_p a run-time number with sum over packs = k, equal on every
    replica.
    """
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)

    def shares(r, *pack_norms):
        idx = select_chunks(tf.concat(list(pack_norms), 0), k)
        bounds = tf.searchsorted(idx, tf.constant(offsets, idx.dtype), side="left")
        return [part - offset for part, offset in zip(tf.split(idx, bounds[1:] - bounds[:-1]),
                                                      offsets)]

    per_replica = comm.map(shares, *norms)
    return [[replica[m] for replica in per_replica] for m in range(len(counts))]

