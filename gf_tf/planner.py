"""The planner: how one variable set's gradients travel, chosen by a measured cost model.

GradientFlow pays off where bytes dominate (large payloads, slow links) and
costs time where latency does (small payloads, fast links, many workers): a
ring all-reduce pays 2(N-1) hop latencies per collective, and FP16 packs need
a collective of their own for the scale bounds. The planner predicts the
seconds of every candidate transport and picks the fastest, so that adding
gf_tf never makes a step slower than TensorFlow's own float32 all-reduce.

Model (alpha-beta model of collectives: Thakur, Rabenseifner & Gropp 2005,
"Optimization of collective communication operations in MPICH"), for N
workers, B payload bytes per worker, E float32 elements:

  ring(B)               = 2(N-1) alpha + 2(N-1)/N B beta
  recursive doubling(B) = R (rho + B beta),  R = log2 N rounds of pairs
                          (+ 2 fold rounds when N is not a power of two)

rho, the latency of one round, is measured on its own: ideally 2 alpha (a
2-member ring), but where worker processes share cores, as on one test
machine, a round costs about a whole collective's scheduling (8-15 ms at
N = 8 on 2 cores, against 1.5 ms per ring hop).
  TF's own ("tf")       = ring(4E) + copy E                (concat + split)
  GradientFlow packs    = [ctl(4T)] + P lat + max(W, L) + min(W, L) / P

where ctl is the FP16 scale bounds' collective (T tensors, scaled wires only),
P the pack count, lat one collective's latency, W the wire time of all packs
and L the measured local cost of the wire format's pack + unpack of E elements.
In the one-barrier form packs leave after the step's last gradient (the
control all-reduce waits for every pack), but within the all-reduce they form
a pipeline: one pack is packed or unpacked while another is on the wire. More
packs hide more of the local work and add one latency each. The overlapped
form (`Plan.groups` > 1, "Overlap" below) cuts the packs into groups, each
with a control collective of its own.

The constants (`Costs`) are measured by `gf_tf.probe` when a
gf_tf.MultiWorkerMirroredStrategy starts and averaged over the workers, so
every worker computes the same plan from the same numbers. Pure Python: the
projection (benchmarks/projection.py) uses the same model.

The model is refined by measurement where it is unsure: a GradientFlow wire
predicted within TRIAL_BAND of TF's own seconds is a `Plan` with `trial`: both
are timed on the set's own shapes when its step is first traced and the faster
is kept (`gf_tf.trial`), decided on all-reduced figures like everything else here.

Overlap (FP16 wires; issue 18). With G groups of the P packs (consecutive, in
backprop order), group g's collectives depend only on group g's gradients, so
they can run while backprop computes the later groups' gradients. What it
costs and gains, in the same model, with C the control collective of T/G
tensors:

  all(G)  = G C + P lat + max(W, L) + min(W, L) G / P
  last(G) = C + (P/G) lat + max(W, L) / G + min(W, L) / P

all(G) is the step's all-reduce when nothing hides (every gradient ready at
once: exactly what the one-barrier form, G = 1, always pays): one more control
collective per group, and the pipeline refills in each group (a group's
packing waits for its own scale). last(G) is the last group alone: what is
left after backprop when every earlier group hid behind it. The planner knows
no compute time, so it cannot tell which one a step will see. The rule
(`choose_overlap`, overlap="auto"): take the G and pack size with the least
last(G) among those with all(G) <= (1 + OVERLAP_SLACK) all(1) of the
one-barrier plan. A step is C_b + all-reduce seconds at worst, so it is never
predicted slower than the one-barrier form by more than OVERLAP_SLACK of its
all-reduce (less of the step), and as fast as last(G) lets it be when backprop
is long enough to hide the rest. With bytes_per_pack="auto" the pack sizes
tried are OVERLAP_PACK_SIZES (smaller packs give more groups and a smaller last
group, for more latency). Without measurements (one worker, or settings
pinned so nothing was probed) "auto" keeps one barrier.
"""

import dataclasses
import math
from typing import List, Optional, Tuple

AUTO = "auto"
RING, RECURSIVE_DOUBLING = "ring", "recursive_doubling"
ALGORITHMS = (RING, RECURSIVE_DOUBLING)   # the order breaks ties: the ring first
# What the planner may choose for the wire of float32 gradients when compression="auto":
# TF's own float32 batch all-reduce, float32 packs over recursive doubling at N > 2 (exact;
# over the ring, or in the one round of N = 2, they are TF's own all-reduce again) or FP16 packs. BF16 (8-bit significand) only when
# a user asks for it.
AUTO_METHODS = ("tf", "none", "fp16")
FLOAT32_BYTES, WIRE16_BYTES = 4, 2
DEFAULT_BYTES_PER_PACK = 4 * 1024 * 1024
# bytes_per_pack="auto" is 4 MiB packs (a set below 4 MiB is one pack). Measured here on
# ResNet-50 (benchmarks.allreduce): 4 MiB packs (13) beat one pack by 11-15% at N = 2 and 4,
# 1 Gbit/s, and 4 packs of 12.8 MB by 3-29% at N = 3 and 4, where the model below called
# one pack and 4 MiB packs a tie: it does not see everything the pipeline hides.
PACK_SIZES = (DEFAULT_BYTES_PER_PACK,)
# compression="auto": where the model is unsure, measure. A GradientFlow wire predicted at most
# TRIAL_BAND[0] of TF's own seconds is taken; one predicted above TRIAL_BAND[1] is not; in between
# both are timed when the set is first traced (`gf_tf.trial`). Measured here, the model's
# error on one all-reduce reaches 1.5-2x: ResNet-20 FP16 at N = 2, 1 Gbit/s was predicted at
# 0.79x TF's time and took 1.1-1.25x; 4-8 processes on 2 cores add scheduling it cannot see.
# Above 1.9 are the latency-bound sets where FP16's two collectives (bounds, pack) face TF's one.
TRIAL_BAND = (0.4, 1.9)
# overlap="auto" (module docstring, "Overlap"): the overlapped form may be predicted at most this
# share slower than the one-barrier form when nothing hides behind backprop ...
OVERLAP_SLACK = 0.05
# ... and with bytes_per_pack="auto" it tries these pack sizes (the first is the one-barrier one).
OVERLAP_PACK_SIZES = (DEFAULT_BYTES_PER_PACK, 1 << 20, 256 << 10)
OVERLAP_CHOICES = (AUTO, True, False)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured constants of the model, in seconds.

    hop_s: alpha, latency of one ring hop of a collective.
    round_s: rho, latency of one round (a 2-member all-reduce) of recursive doubling.
    byte_s: beta, wire time of one payload byte on one link.
    copy_s: local time per float32 element of a float32 pack + unpack
      (what TF's batch all-reduce does: concat, split).
    fp16_s: local time per float32 element of the FP16 path (max |g|, scaled
      pack to float16, unpack).
    """
    hop_s: float
    round_s: float
    byte_s: float
    copy_s: float
    fp16_s: float

    def as_list(self):
        return [self.hop_s, self.round_s, self.byte_s, self.copy_s, self.fp16_s]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The transport of one variable set's float32/float16/bfloat16 gradients.

    method: "tf" (the wrapped TF cross-device ops' own float32 batch
      all-reduce, gf_tf sends nothing itself), or a GradientFlow wire:
      "fp16", "bf16" or "none" (packs in their own dtype).
    bytes_per_pack: pack threshold in wire bytes (0: one pack per dtype).
    algorithm: "ring" (the wrapped TF ops) or "recursive_doubling" (gf_tf.collectives).
    seconds: predicted seconds of the step's all-reduce when nothing hides behind
      backprop (None: not modelled, e.g. one worker or settings pinned without
      measurements).
    groups: consecutive groups the packs are cut into, each with its own control
      collective (FP16 wires; 1: one barrier, every pack waits for the step's
      last gradient; `gf_tf.reducers.group_ranges`).
    last_seconds: with groups > 1, the predicted seconds of the last group alone
      (what is left after backprop at best), or None.
    trial: this GradientFlow wire is timed against TensorFlow's own float32
      all-reduce when the set is first traced and the faster is kept (`gf_tf.trial`);
      tf_seconds is then TF's own predicted seconds.
    measured: once a trial has decided, (TF's own, the GradientFlow wire's) measured
      seconds per all-reduce (mean over workers of each worker's median); else None.
    """
    method: str
    bytes_per_pack: int
    algorithm: str
    seconds: Optional[float] = None
    groups: int = 1
    last_seconds: Optional[float] = None
    trial: bool = False
    tf_seconds: Optional[float] = None
    measured: Optional[Tuple[float, float]] = None

    @property
    def steady_seconds(self) -> Optional[float]:
        """Predicted seconds once any trial has decided: the lesser of the two for a trial plan."""
        if self.trial and self.seconds is not None and self.tf_seconds is not None:
            return min(self.seconds, self.tf_seconds)
        return self.seconds

    @property
    def compression(self) -> Optional[str]:
        """The GradientFlowAllReduce compression name of a GradientFlow wire (None for "none")."""
        return None if self.method in ("tf", "none") else self.method

    def describe(self) -> str:
        if self.method == "tf":
            what = "TensorFlow's own float32 all-reduce"
        else:
            packs = "one pack per dtype" if not self.bytes_per_pack else \
                f"packs of {self.bytes_per_pack} bytes"
            wire = "float32" if self.method == "none" else self.method
            what = f"{wire} packs ({packs}), {self.algorithm.replace('_', ' ')}"
            what += f", {self.groups} groups overlapped with backprop" if self.groups > 1 \
                else ", one barrier" if self.method == "fp16" else ""
        if self.trial:
            what = (f"{what}, or TensorFlow's own float32 all-reduce, whichever measures faster "
                    f"at the first trace")
        if self.seconds is not None:
            what = f"{what}, predicted {1000 * self.seconds:.2f} ms per step"
            if self.trial and self.tf_seconds is not None:
                what = f"{what} against {1000 * self.tf_seconds:.2f} ms"
            if self.last_seconds is not None:
                what = f"{what} ({1000 * self.last_seconds:.2f} ms after the last gradient at best)"
        if self.measured is not None:
            tf_s, gf_s = self.measured
            what = (f"{what}; measured {1000 * gf_s:.2f} ms (GradientFlow) against "
                    f"{1000 * tf_s:.2f} ms (TensorFlow's own)")
        return what


def recursive_doubling_rounds(workers: int) -> int:
    """Rounds of 2-member all-reduces of recursive doubling over `workers` (0 for 1)."""
    if workers <= 1:
        return 0
    power = int(math.floor(math.log2(workers)))
    return power + (0 if 2 ** power == workers else 2)


def collective_seconds(algorithm: str, nbytes: float, workers: int, costs: Costs) -> float:
    """Predicted seconds of one SUM all-reduce of `nbytes` per worker (module docstring)."""
    if workers <= 1:
        return 0.0
    if algorithm == "ring":
        hops = 2 * (workers - 1)
        return hops * costs.hop_s + hops / workers * nbytes * costs.byte_s
    if algorithm == "recursive_doubling":
        return recursive_doubling_rounds(workers) * (costs.round_s + nbytes * costs.byte_s)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {ALGORITHMS}")


def predict_seconds(method: str, algorithm: str, elements: float, tensors: float, workers: int,
                    costs: Costs, packs: float = 1, groups: int = 1) -> float:
    """Predicted seconds of one step's all-reduce of `elements` float32 gradients in `tensors`
    tensors by `method` ("tf", "fp16", "bf16", "none") over `algorithm`, in `packs` packs,
    cut into `groups` groups (FP16; module docstring, "Overlap"), nothing hidden by backprop.

    GradientFlow's packs form a two-stage pipeline (the local pack/unpack of one pack runs
    while another is on the wire): with W the wire time and L the local time of the
    whole set, T = [control] + packs x latency + max(W, L) + min(W, L) / packs.
    TF's own batch all-reduce is one collective after one concat: ring(4E) + copy E.
    """
    if method == "tf":
        return collective_seconds("ring", FLOAT32_BYTES * elements, workers, costs) \
            + costs.copy_s * elements
    wire = FLOAT32_BYTES if method == "none" else WIRE16_BYTES
    latency = collective_seconds(algorithm, 0, workers, costs)
    wire_s = collective_seconds(algorithm, wire * elements, workers, costs) - latency
    local_s = (costs.fp16_s if method == "fp16" else costs.copy_s) * elements
    groups = max(1, groups) if method == "fp16" else 1   # other wires have no control barrier
    control = groups * collective_seconds(algorithm, FLOAT32_BYTES * tensors / groups, workers,
                                          costs) if method == "fp16" else 0.0
    packs = max(1, packs)
    return control + packs * latency + max(wire_s, local_s) + min(wire_s, local_s) * groups / packs


def last_group_seconds(method: str, algorithm: str, elements: float, tensors: float, workers: int,
                       costs: Costs, packs: float, groups: int) -> float:
    """Predicted seconds of the last of `groups` equal groups of `packs` packs on its own
    (module docstring, "Overlap": last(G))."""
    return predict_seconds(method, algorithm, elements / groups, tensors / groups, workers, costs,
                           packs / groups)


def choose(elements: int, tensors: int, workers: int, costs: Optional[Costs],
           method: str = AUTO, algorithm: str = AUTO, bytes_per_pack=AUTO, overlap=False) -> Plan:
    """The plan of one variable set: the pinned settings kept, the "auto" ones chosen.

    Args:
      elements / tensors: float32 elements and tensors of the set's packable gradients.
      workers: N.
      costs: the measured constants, or None (one worker, or not measured): then
        "auto" means TF's own all-reduce when the method is "auto" (nothing to save
        without a network), the ring, and 4 MiB packs.
      method: "auto" or a pinned "fp16" / "bf16" / "none".
      algorithm: "auto" or a pinned one of ALGORITHMS.
      bytes_per_pack: "auto" (one of PACK_SIZES) or a pinned number of bytes.
      overlap: "auto", True or False (default): how an FP16 plan's packs are grouped
        (`choose_overlap`).

    Returns: the Plan with the lowest predicted seconds (ties go to the earlier candidate:
      "tf", the ring, fewer packs), except with method "auto", where the model's error is
      larger than many of its margins: the best GradientFlow wire is taken outright only
      when predicted at most TRIAL_BAND[0] of TF's own seconds, TF's own when the wire is
      predicted above TRIAL_BAND[1] of it, and in between the wire with `trial` set (both
      timed at the set's first trace; `gf_tf.trial`). The same on every worker given the same
      arguments.
    """
    methods = AUTO_METHODS if method == AUTO else (method,)
    algorithms = ALGORITHMS if algorithm == AUTO else (algorithm,)
    if costs is None or workers <= 1:
        if method == AUTO:
            return Plan("tf", 0 if bytes_per_pack == AUTO else int(bytes_per_pack), algorithms[0])
        return choose_overlap(Plan(method, _pack_options(elements, method, bytes_per_pack)[0][1],
                                   algorithms[0]), elements, tensors, workers, costs, overlap,
                              bytes_per_pack)
    candidates: List[Plan] = []
    for m in methods:
        for a in (RING,) if m == "tf" else algorithms:
            if method == AUTO and m == "none" and (a == RING or workers <= 2):
                continue   # TF's own all-reduce again (at N = 2 one round is a 2-member ring)
            for count, pack in _pack_options(elements, m, bytes_per_pack):
                candidates.append(Plan(m, pack, a, predict_seconds(
                    m, a, elements, tensors, workers, costs, count)))
    wires = [plan for plan in candidates if plan.method != "tf"]
    best = min(wires or candidates, key=lambda plan: plan.seconds)
    if method == AUTO:
        tf_own = candidates[0]
        ratio = best.seconds / tf_own.seconds if tf_own.seconds > 0 else math.inf
        if ratio > TRIAL_BAND[1]:
            return tf_own
        if ratio >= TRIAL_BAND[0]:
            best = dataclasses.replace(best, trial=True, tf_seconds=tf_own.seconds)
    return choose_overlap(best, elements, tensors, workers, costs, overlap, bytes_per_pack)


def check_overlap(overlap):
    """`overlap` if it is one of OVERLAP_CHOICES ("auto", True, False), else ValueError."""
    if not any(overlap is c or (isinstance(c, str) and overlap == c) for c in OVERLAP_CHOICES):
        raise ValueError(f"overlap must be \"auto\", True or False, got {overlap!r}")
    return overlap


def with_pack_count(plan: Plan, packs: int, overlap) -> Plan:
    """`plan` with its groups fitted to the `packs` packs (with elements) actually cut:
    one per pack for overlap=True on FP16, else at most one per pack, at least 1."""
    groups = packs if overlap is True and plan.method == "fp16" else min(plan.groups, packs)
    return dataclasses.replace(plan, groups=max(1, groups))


def choose_overlap(plan: Plan, elements: int, tensors: int, workers: int, costs: Optional[Costs],
                   overlap=AUTO, bytes_per_pack=AUTO) -> Plan:
    """`plan` with its packs grouped for overlap (module docstring, "Overlap").

    Args:
      plan: the one-barrier plan (`choose`); only an "fp16" plan has groups to choose.
      overlap: False: one barrier (plan unchanged). True: one group per pack; with
        bytes_per_pack "auto" and measurements, of the OVERLAP_PACK_SIZES that give 2
        packs or more (if any), the one with the least all(G): the least harm when
        nothing hides.
        "auto": the rule: the least last(G) with all(G) <= (1 + OVERLAP_SLACK) all(1);
        one barrier without measurements.
      bytes_per_pack: the setting ("auto" or pinned bytes): whether the size may change.

    Returns:
      the Plan with groups (an estimate from the element count; the caller clamps it to
      the packs it cuts), bytes_per_pack, seconds = all(G) and last_seconds = last(G)
      (None for one group). Ties go to fewer groups, then to larger packs.
    """
    if plan.method != "fp16" or overlap is False:
        return plan
    modelled = costs is not None and workers > 1
    sizes = OVERLAP_PACK_SIZES if bytes_per_pack == AUTO and modelled else (plan.bytes_per_pack,)
    options = []   # (size, packs, groups)
    for size in sizes:
        count = _pack_options(elements, plan.method, size)[0][0]
        options += [(size, count, g) for g in ((count,) if overlap is True else range(1, count + 1))]
    if not modelled:
        return dataclasses.replace(plan, groups=options[0][2] if overlap is True else 1)

    def all_s(option):
        return predict_seconds(plan.method, plan.algorithm, elements, tensors, workers, costs,
                               option[1], option[2])

    def last_s(option):
        return last_group_seconds(plan.method, plan.algorithm, elements, tensors, workers, costs,
                                  option[1], option[2])

    if overlap is True:   # the least all(G) of one group per pack, 2 packs or more if any size gives them
        options = [o for o in options if o[2] > 1] or options
        size, count, groups = min(options, key=lambda o: (all_s(o), sizes.index(o[0])))
    else:
        barrier = (plan.bytes_per_pack, _pack_options(elements, plan.method,
                                                      plan.bytes_per_pack)[0][0], 1)
        budget = (1 + OVERLAP_SLACK) * all_s(barrier)
        options = [o for o in options if all_s(o) <= budget] or [barrier]
        size, count, groups = min(options, key=lambda o: (last_s(o), o[2], sizes.index(o[0])))
    return dataclasses.replace(plan, bytes_per_pack=size, groups=groups,
                               seconds=all_s((size, count, groups)),
                               last_seconds=last_s((size, count, groups)) if groups > 1 else None)


def _pack_options(elements: int, method: str, bytes_per_pack) -> List[Tuple[int, int]]:
    """(pack count, bytes_per_pack) to consider: PACK_SIZES for "auto", else the pinned size
    (0: one pack), with the count it gives (tensors are not split: approximate)."""
    wire = FLOAT32_BYTES if method in ("tf", "none") else WIRE16_BYTES
    sizes = PACK_SIZES if bytes_per_pack == AUTO else (int(bytes_per_pack),)
    if method == "tf":   # TF's own batch all-reduce: one collective, no pack size of ours
        return [(1, 0 if bytes_per_pack == AUTO else int(bytes_per_pack))]
    options = {}
    for size in sizes:
        count = max(1, math.ceil(wire * elements / size)) if size else 1
        options.setdefault(count, size)   # equal counts: the first size
    return sorted(options.items())


def choose_sparse_algorithm(norm_bytes: int, chunk_bytes: int, workers: int,
                            costs: Optional[Costs], algorithm: str = AUTO) -> str:
    """The algorithm for CSC's two collectives (the chunk norms, `norm_bytes`, then the
    selected chunks, `chunk_bytes`, per worker): the pinned one, or the faster one
    (the ring without measurements)."""
    if algorithm != AUTO:
        return algorithm
    if costs is None or workers <= 1:
        return ALGORITHMS[0]
    return min(ALGORITHMS, key=lambda a: collective_seconds(a, norm_bytes, workers, costs)
               + collective_seconds(a, chunk_bytes, workers, costs))


def choose_sparse_groups(packs: int, norm_bytes: int, chunk_bytes: int, workers: int,
                         costs: Optional[Costs], algorithm: str, overlap) -> int:
    """How many groups CSC's packs are cut into, each with its own norms' and chunks'
    collectives (overlap with backprop; `gf_tf.csc.reducer`).

    Args:
      packs: packs with elements; norm_bytes / chunk_bytes: the step's chunk norms and
        selected chunks per worker (`ChunkSparsity.step_bytes`); algorithm: theirs.
      overlap: False (1), True (one group per pack) or "auto": with G groups the step
        costs all(G) = 2 G lat + W when nothing hides, and the last group alone
        last(G) = 2 lat + W / G (W: the wire time of both collectives' bytes); the G with
        the least last(G) among those with all(G) <= (1 + OVERLAP_SLACK) all(1), as for
        FP16 (module docstring, "Overlap"). 1 without measurements.
    """
    packs = max(1, packs)
    if overlap is True:
        return packs
    if overlap is False or costs is None or workers <= 1:
        return 1
    latency = collective_seconds(algorithm, 0, workers, costs)
    wire = sum(collective_seconds(algorithm, b, workers, costs) - latency
               for b in (norm_bytes, chunk_bytes))

    def all_s(g):
        return 2 * g * latency + wire

    fits = [g for g in range(1, packs + 1) if all_s(g) <= (1 + OVERLAP_SLACK) * all_s(1)]
    return min(fits, key=lambda g: (2 * latency + wire / g, g))
