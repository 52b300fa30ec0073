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

Each algorithm's latency unit (alpha for a ring hop, rho for a round) is
measured on its own (`gf_tf.plan.probe`): ideally rho = 2 alpha (a 2-member
ring), but where worker processes share cores a round costs about a whole
collective's scheduling. The formulas live beside each algorithm
(`gf_tf.collectives`), and a wire format's bytes and local cost beside it
(`gf_tf.wire`, `Costs.local_s`); the planner only combines them.
  TF's own ("tf")       = ring(4E) + copy E                (concat + split)
  GradientFlow packs    = [ctl(4T)] + P lat + max(W, L) + min(W, L) / P

where ctl is the scale bounds' collective (T tensors, scaled wires only),
P the pack count, lat one collective's latency, W the wire time of all packs
and L the measured local cost of the wire format's pack + unpack of E elements.
In the one-barrier form packs leave after the step's last gradient (the
control all-reduce waits for every pack), but within the all-reduce they form
a pipeline: one pack is packed or unpacked while another is on the wire. More
packs hide more of the local work and add one latency each. The overlapped
form (`Plan.groups` > 1, "Overlap" below) cuts the packs into groups, each
with a control collective of its own.

The constants (`Costs`) are measured by `gf_tf.plan.probe` when a
gf_tf.MultiWorkerMirroredStrategy starts and averaged over the workers, so
every worker computes the same plan from the same numbers. Pure Python: the
projection (benchmarks/projection.py) uses the same model.

The model is refined by measurement where it is unsure: a GradientFlow wire
predicted below TF's own seconds by a margin its error could close is a `Plan` with `trial`: both
are timed on the set's own shapes when its step is first traced and the faster
is kept (`gf_tf.plan.trial`), decided on all-reduced figures like everything else here.

Overlap (`choose_overlap`, overlap="auto"): a scaled wire's packs may be cut into G
groups, each with its own control collective, so a group leaves while backprop
computes the rest. all(G) is the step's all-reduce when nothing hides, last(G)
the last group alone; the rule takes the least last(G) among the G (and, with
bytes_per_pack="auto", the pack sizes OVERLAP_PACK_SIZES) whose all(G) is within
OVERLAP_SLACK of the one-barrier plan's. The formulas and the table of choices:
docs/planner.md, "Overlap groups".
"""

import dataclasses
import math
from typing import List, Optional, Tuple

from gf_tf import collectives, wire
from gf_tf.plan import trial
from gf_tf.plan.records import TF_OWN, Costs, Forecast, Plan, Planned
from gf_tf.reducers.base import CostTerms

AUTO = "auto"
FLOAT32_BYTES = 4
DEFAULT_BYTES_PER_PACK = 4 * 1024 * 1024
# bytes_per_pack="auto" is 4 MiB packs (a set below 4 MiB is one pack): on large sets they beat
# one pack in benchmarks/allreduce.py (docs/benchmarks.md), where the model below calls the two
# a tie, because it does not see everything the pipeline hides.
PACK_SIZES = (DEFAULT_BYTES_PER_PACK,)
# compression="auto": where the model is unsure, measure. A GradientFlow wire predicted to save less
# than a tenth of TF's own seconds (at or above TIE of them) is not worth a trial: TF's own, untimed
# (the trial costs 0.2-0.4 s of the first step, and its timings of a few-ms all-reduce spread more
# than that tenth where worker processes share cores, docs/planner.md). A wire the trial would keep
# (below trial.KEEP_IF of TF's seconds) even with what it adds to TF's own one collective (more
# latencies, its local work) at MODEL_ERROR times the prediction, or what it saves of it (fewer
# rounds) at 1 / MODEL_ERROR, is taken untimed: the model's error lives there (up to 2x,
# docs/planner.md), not in the bytes or the latency both pay.
# In between both are timed when the set is first traced (`gf_tf.plan.trial`).
TIE = 0.9
MODEL_ERROR = 2.0
# overlap="auto" (module docstring, "Overlap"): the overlapped form may be predicted at most this
# share slower than the one-barrier form when nothing hides behind backprop ...
OVERLAP_SLACK = 0.05
# ... and with bytes_per_pack="auto" it tries these pack sizes (the first is the one-barrier one).
OVERLAP_PACK_SIZES = (DEFAULT_BYTES_PER_PACK, 1 << 20, 256 << 10)
OVERLAP_CHOICES = (AUTO, True, False)


def auto_methods() -> Tuple[str, ...]:
    """What compression="auto" chooses among: TF's own all-reduce, then every wire format
    registered with auto=True, in registry order (float32 packs and FP16 by default)."""
    return (TF_OWN,) + tuple(f.method for f in wire.FORMATS.values() if f.auto)


def collective_seconds(algorithm: str, nbytes: float, workers: int, costs: Costs) -> float:
    """Predicted seconds of one SUM all-reduce of `nbytes` per worker (`gf_tf.collectives`)."""
    return collectives.get(algorithm).seconds(nbytes, workers, costs.latency_s[algorithm],
                                              costs.byte_s)


def latency_bytes(algorithm: str, workers: int, costs: Optional[Costs]) -> float:
    """Bytes one all-reduce of `algorithm` over `workers` could carry in its latency term: the
    latency seconds over the seconds per byte (`gf_tf.collectives.Algorithm`'s alpha-beta
    cost). 0.0 without measured costs or peers, or when a byte costs nothing.

    Used by density="auto" (`gf_tf.csc.choose_rung`) to leave a latency-bound all-reduce's fixed
    cost out of what a denser rung would add."""
    if costs is None or workers <= 1:
        return 0.0
    fixed = collective_seconds(algorithm, 0.0, workers, costs)
    per_byte = collective_seconds(algorithm, 1.0, workers, costs) - fixed
    return fixed / per_byte if per_byte > 0.0 else 0.0


def wire_seconds(method: str, algorithm: str, elements: float, tensors: float, workers: int,
                 costs: Costs, packs: float = 1, control: bool = True) -> float:
    """The bytes' part of `predict_seconds` for a GradientFlow wire `method`: its packs' bytes
    (with the bounds riding in them, control=False) on the wire, latencies excluded."""
    fmt = wire.format_of(method)
    slots = (fmt.wire_bytes * (2 * tensors + max(1, packs) * wire.ahead_slots(0))
             if fmt.scaled and not control else 0)
    return (collective_seconds(algorithm, fmt.wire_bytes * elements + slots, workers, costs)
            - collective_seconds(algorithm, 0, workers, costs))


def predict_seconds(method: str, algorithm: str, elements: float, tensors: float, workers: int,
                    costs: Costs, packs: float = 1, groups: int = 1, control: bool = True) -> float:
    """Predicted seconds of one step's all-reduce of `elements` float32 gradients in `tensors`
    tensors by `method` over `algorithm`, in `packs` packs, cut into `groups` groups (scaled
    wires; module docstring, "Overlap"), nothing hidden by backprop. control=False: a scaled
    wire's packs need no control collective (the dense reducer scales them a step ahead,
    `Reducer.wire_control`): their bounds ride in the packs, `wire.ahead_slots` of the wire's
    dtype per pack (2T in all, plus a fixed number per pack).

    GradientFlow's packs form a two-stage pipeline (the local pack/unpack of one pack runs
    while another is on the wire): with W the wire time and L the local time of the
    whole set, T = [control] + packs x latency + max(W, L) + min(W, L) / packs.
    TF's own batch all-reduce is one collective after one concat: ring(4E) + copy E.
    """
    if method == TF_OWN:
        return collective_seconds(collectives.tf_own().name, FLOAT32_BYTES * elements, workers,
                                  costs) + costs.local_s[wire.NO_COMPRESSION] * elements
    fmt = wire.format_of(method)
    latency = collective_seconds(algorithm, 0, workers, costs)
    wire_s = wire_seconds(method, algorithm, elements, tensors, workers, costs, packs, control)
    local_s = costs.local_s[method] * elements
    barrier = fmt.scaled and control
    groups = max(1, groups) if barrier else 1   # other wires have no control barrier
    control_s = groups * collective_seconds(algorithm, FLOAT32_BYTES * tensors / groups, workers,
                                            costs) if barrier else 0.0
    packs = max(1, packs)
    return control_s + packs * latency + max(wire_s, local_s) + min(wire_s, local_s) * groups / packs


def last_group_seconds(method: str, algorithm: str, elements: float, tensors: float, workers: int,
                       costs: Costs, packs: float, groups: int) -> float:
    """Predicted seconds of the last of `groups` equal groups of `packs` packs on its own
    (module docstring, "Overlap": last(G))."""
    return predict_seconds(method, algorithm, elements / groups, tensors / groups, workers, costs,
                           packs / groups)


def choose(elements: int, tensors: int, workers: int, costs: Optional[Costs],
           method: str = AUTO, algorithm: str = AUTO, bytes_per_pack=AUTO, overlap=False,
           control: bool = True) -> Planned:
    """The plan of one variable set: the pinned settings kept, the "auto" ones chosen.

    Args:
      elements / tensors: float32 elements and tensors of the set's packable gradients.
      workers: N.
      costs: the measured constants, or None (one worker, or not measured): then
        "auto" means TF's own all-reduce when the method is "auto" (nothing to save
        without a network), the first algorithm (the ring), and 4 MiB packs.
      method: "auto" or a pinned wire method ("fp16", "bf16", "none", ...).
      algorithm: "auto" or a pinned `gf_tf.collectives.ALGORITHMS` name.
      bytes_per_pack: "auto" (one of PACK_SIZES) or a pinned number of bytes.
      overlap: "auto", True or False (default): how a scaled wire's packs are grouped
        (`choose_overlap`).
      control: a scaled wire's packs need a control collective first (`predict_seconds`);
        without one they have no barrier to cut into groups, and `overlap` changes nothing.

    Returns:
      the Plan with the lowest predicted seconds and its Forecast (ties go to the
      earlier candidate: "tf", the first algorithm, fewer packs), except with method "auto",
      where the model's error is larger than many of its margins: TF's own when the best
      GradientFlow wire is predicted at TIE of its seconds or more; the wire, untimed, when it
      would stay below `trial.KEEP_IF` of them with what it adds to TF's own one collective
      (its seconds but `wire_seconds` and TF's latency) at MODEL_ERROR times the prediction
      (what it saves, at 1 / MODEL_ERROR);
      else the wire with `trial` set (both timed at the set's first trace). The same on every
      worker given the same arguments.
    """
    methods = auto_methods() if method == AUTO else (method,)
    algorithms = tuple(collectives.ALGORITHMS) if algorithm == AUTO else (algorithm,)
    if costs is None or workers <= 1:
        if method == AUTO:
            return Planned(Plan(TF_OWN, 0 if bytes_per_pack == AUTO else int(bytes_per_pack),
                                algorithms[0]), Forecast())
        plan = Plan(method, pack_options(elements, method, bytes_per_pack)[0][1], algorithms[0])
        return choose_overlap(Planned(plan, Forecast()), elements, tensors, workers, costs,
                              overlap, bytes_per_pack, control)
    candidates: List[Tuple[Plan, float, int]] = []
    for m in methods:
        for a in (collectives.tf_own().name,) if m == TF_OWN else algorithms:
            if (method == AUTO and m != TF_OWN and wire.format_of(m).exact
                    and collectives.get(a).same_as_tf_own(workers)):
                continue   # TF's own all-reduce again
            for count, pack in pack_options(elements, m, bytes_per_pack):
                candidates.append((Plan(m, pack, a), predict_seconds(
                    m, a, elements, tensors, workers, costs, count, control=control), count))
    wires = [c for c in candidates if c[0].method != TF_OWN]
    best, seconds, count = min(wires or candidates, key=lambda c: c[1])
    forecast = Forecast(seconds)
    if method == AUTO:
        tf_own, tf_seconds, _ = candidates[0]
        if not seconds < TIE * tf_seconds:
            return Planned(tf_own, Forecast(tf_seconds))
        beyond_tf = (seconds - collective_seconds(tf_own.algorithm, 0.0, workers, costs)
                     - wire_seconds(best.method, best.algorithm, elements, tensors, workers, costs,
                                    count, control))
        erred = MODEL_ERROR * beyond_tf if beyond_tf > 0 else beyond_tf / MODEL_ERROR
        if not seconds - beyond_tf + erred < trial.KEEP_IF * tf_seconds:
            best, forecast = dataclasses.replace(best, trial=True), Forecast(seconds,
                                                                             tf_seconds=tf_seconds)
    return choose_overlap(Planned(best, forecast), elements, tensors, workers, costs, overlap,
                          bytes_per_pack, control)


def check_overlap(overlap):
    """`overlap` if it is one of OVERLAP_CHOICES ("auto", True, False), else ValueError."""
    if not any(overlap is c or (isinstance(c, str) and overlap == c) for c in OVERLAP_CHOICES):
        raise ValueError(f"overlap must be \"auto\", True or False, got {overlap!r}")
    return overlap


def with_pack_count(plan: Plan, packs: int, overlap) -> Plan:
    """`plan` with its groups fitted to the `packs` packs (with elements) actually cut:
    one per pack for overlap=True on a scaled wire, else at most one per pack, at least 1."""
    groups = packs if overlap is True and plan.scaled else min(plan.groups, packs)
    return dataclasses.replace(plan, groups=max(1, groups))


def choose_overlap(planned: Planned, elements: int, tensors: int, workers: int,
                   costs: Optional[Costs], overlap=AUTO, bytes_per_pack=AUTO,
                   control: bool = True) -> Planned:
    """`planned` with its packs grouped for overlap (module docstring, "Overlap").

    Args:
      planned: the one-barrier plan (`choose`); only a scaled wire has groups to choose.
      overlap: False: one barrier (plan unchanged). True: one group per pack; with
        bytes_per_pack "auto" and measurements, of the OVERLAP_PACK_SIZES that give 2
        packs or more (if any), the one with the least all(G): the least harm when
        nothing hides.
        "auto": the rule: the least last(G) with all(G) <= (1 + OVERLAP_SLACK) all(1);
        one barrier without measurements.
      bytes_per_pack: the setting ("auto" or pinned bytes): whether the size may change.
      control: whether the packs wait for a control collective (`choose`); without that
        barrier there is nothing to cut into groups (plan unchanged).

    Returns:
      the Plan with groups (an estimate from the element count; the caller clamps it to
      the packs it cuts) and bytes_per_pack, with seconds = all(G) and last_seconds =
      last(G) (None for one group) in its Forecast. Ties go to fewer groups, then to
      larger packs.
    """
    plan = planned.plan
    if not plan.scaled or overlap is False or not control:
        return planned
    modelled = costs is not None and workers > 1
    sizes = OVERLAP_PACK_SIZES if bytes_per_pack == AUTO and modelled else (plan.bytes_per_pack,)
    options = []   # (size, packs, groups)
    for size in sizes:
        count = pack_options(elements, plan.method, size)[0][0]
        options += [(size, count, g) for g in ((count,) if overlap is True else range(1, count + 1))]
    if not modelled:
        return Planned(dataclasses.replace(plan, groups=options[0][2] if overlap is True else 1),
                       planned.forecast)

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
        barrier = (plan.bytes_per_pack, pack_options(elements, plan.method,
                                                      plan.bytes_per_pack)[0][0], 1)
        budget = (1 + OVERLAP_SLACK) * all_s(barrier)
        options = [o for o in options if all_s(o) <= budget] or [barrier]
        size, count, groups = min(options, key=lambda o: (last_s(o), o[2], sizes.index(o[0])))
    forecast = dataclasses.replace(planned.forecast, seconds=all_s((size, count, groups)),
                                   last_seconds=last_s((size, count, groups)) if groups > 1 else None)
    return Planned(dataclasses.replace(plan, bytes_per_pack=size, groups=groups), forecast)


def pack_options(elements: int, method: str, bytes_per_pack) -> List[Tuple[int, int]]:
    """(pack count, bytes_per_pack) of `elements` float32 elements on `method`'s wire to consider: PACK_SIZES for "auto", else the pinned size
    (0: one pack), with the count it gives (tensors are not split: approximate)."""
    if method == TF_OWN:   # TF's own batch all-reduce: one collective, no pack size of ours
        return [(1, 0 if bytes_per_pack == AUTO else int(bytes_per_pack))]
    wire_bytes = wire.format_of(method).wire_bytes
    sizes = PACK_SIZES if bytes_per_pack == AUTO else (int(bytes_per_pack),)
    options = {}
    for size in sizes:
        count = max(1, math.ceil(wire_bytes * elements / size)) if size else 1
        options.setdefault(count, size)   # equal counts: the first size
    return sorted(options.items())


def choose_fixed_algorithm(terms: CostTerms, workers: int, costs: Optional[Costs],
                           algorithm: str = AUTO) -> str:
    """The algorithm for a reducer's own collectives (`CostTerms.collective_bytes` per
    worker): the pinned one, or the fastest (the first algorithm without measurements)."""
    if algorithm != AUTO:
        return algorithm
    names = list(collectives.ALGORITHMS)
    if costs is None or workers <= 1:
        return names[0]
    return min(names, key=lambda a: sum(collective_seconds(a, b, workers, costs)
                                        for b in terms.collective_bytes))


def choose_fixed_groups(packs: int, terms: CostTerms, workers: int, costs: Optional[Costs],
                        algorithm: str, overlap) -> int:
    """How many groups a reducer with its own collectives (`CostTerms`) cuts its packs into,
    each group issuing those collectives over its share (overlap with backprop).

    Args:
      packs: packs with elements; terms: the reducer's collectives; algorithm: theirs.
      overlap: False (1), True (one group per pack) or "auto": with C collectives and G
        groups the step costs all(G) = C G lat + W when nothing hides, and the last group
        alone last(G) = C lat + W / G (W: the wire time of the collectives' bytes); the G
        with the least last(G) among those with all(G) <= (1 + OVERLAP_SLACK) all(1), as
        for scaled wires (module docstring, "Overlap"). 1 without measurements, and for
        a reducer that cannot be grouped.
    """
    packs = max(1, packs)
    if not terms.groupable or overlap is False:
        return 1
    if overlap is True:
        return packs
    if costs is None or workers <= 1:
        return 1
    latency = collective_seconds(algorithm, 0, workers, costs)
    count = len(terms.collective_bytes)
    wire_s = sum(collective_seconds(algorithm, b, workers, costs) - latency
                 for b in terms.collective_bytes)

    def all_s(g):
        return count * g * latency + wire_s

    fits = [g for g in range(1, packs + 1) if all_s(g) <= (1 + OVERLAP_SLACK) * all_s(1)]
    return min(fits, key=lambda g: (count * latency + wire_s / g, g))
