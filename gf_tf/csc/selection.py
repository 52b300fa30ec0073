"""CSC selection: chunk counts, top-k, the selection policies and the plan of one step.

A `StepPlan` is computed once per candidate density of a trace (a schedule
stage or an auto rung): per pack its k, per wire group (the packs of one wire
dtype, one chunk all-reduce each) its static buffer length, and the bytes and
chunks the step sends. Wire shapes are static, so every plan is Python numbers.
"""

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf.packing import PackSpec


def selected_chunk_count(num_chunks: int, density: float) -> int:
    """k = max(1, ceil(density * num_chunks)), at most num_chunks.

    The product is rounded to 9 decimals first so that e.g. 0.07 * 100
    (7.000000000000001 in binary floating point) gives 7, not 8.
    Returns 0 for a pack of 0 chunks.
    """
    if num_chunks <= 0:
        return 0
    return min(num_chunks, max(1, math.ceil(round(density * num_chunks, 9))))


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


class PerPackSelection:
    """selection="per_pack": each pack sends its own top k of its C_p chunks."""
    name = "per_pack"

    @staticmethod
    def competing(counts: Sequence[int], members: Sequence[int]) -> List[int]:
        """Per member pack, the chunks its k is taken over: its own."""
        return [counts[j] for j in members]

    @staticmethod
    def group_top_k(ks, members) -> Optional[int]:
        """The K of one top K over the group's chunks: none here (each pack its own)."""
        return None


class GlobalSelection:
    """selection="global": one top K over the chunks of all packs of one wire group."""
    name = "global"

    @staticmethod
    def competing(counts, members):
        total = sum(counts[j] for j in members)
        return [total] * len(members)

    @staticmethod
    def group_top_k(ks, members):
        """The group's K (each member's k is it), or None when K covers the group whole."""
        return ks[members[0]]


class AheadSelection(PerPackSelection):
    """selection="ahead": each pack sends its own top k of its C_p chunks, chosen at the
    previous step from all-reduced scores (`gf_tf.csc.ahead`), so a sparse step needs no norm
    all-reduce before its chunk all-reduce: the next step's scores travel in the same buffer."""
    name = "ahead"


POLICIES = {policy.name: policy
            for policy in (PerPackSelection(), GlobalSelection(), AheadSelection())}


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
    """Positions of `specs` grouped by wire dtype (one chunk all-reduce each), in pack order."""
    groups = {}
    for j, spec in enumerate(specs):
        groups.setdefault(spec.wire_dtype, []).append(j)
    return tuple(tuple(members) for members in groups.values())


def plan_step(specs: Sequence[PackSpec], counts: Sequence[int], groups, chunk_size: int,
              policy, first_step: Optional[int], density: float, control_bytes: int) -> StepPlan:
    """The StepPlan of `density`. counts: per pack its chunks; groups: `wire_groups(specs)`;
    policy: one of POLICIES; control_bytes: the step's own control vector, in bytes."""
    ks: List[Optional[int]] = [None] * len(specs)
    for members in groups:
        for j, competing in zip(members, policy.competing(counts, members)):
            k = selected_chunk_count(competing, density)
            ks[j] = None if k >= competing else k
    plans, sent, selected = [], control_bytes, 0
    ahead = policy.name == AheadSelection.name and density < 1.0
    for members in groups:
        top_k = policy.group_top_k(ks, members)
        if top_k is not None:
            length, chunks = top_k * chunk_size, top_k
        else:
            length = sum(specs[j].num_elements if ks[j] is None else ks[j] * chunk_size
                         for j in members)
            chunks = sum(counts[j] if ks[j] is None else ks[j] for j in members)
        size = specs[members[0]].wire_dtype.size
        if ahead:   # the next step's scores and bound ride in the chunks' buffer
            length += sum(counts[j] + 1 for j in members)
            sent += length * size
        else:
            sent += 4 * sum(counts[j] for j in members) + length * size
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
