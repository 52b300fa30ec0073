"""How one variable set's gradients travel: the settings, the planner, its probe and its trial.

`plan_set` is the one place that turns a gradient signature into a plan: it
asks the planner (`planner`, from the registries' cost terms and the probe's
measured `Costs`), then cuts the packs (`gf_tf.packing`) and fits the overlap
groups to the packs actually cut. `trial` times TF's own all-reduce against the
planned wire where the model cannot tell them apart.
"""

import dataclasses
from typing import NamedTuple, Optional, Sequence, Tuple, Union

from gf_tf import collectives, packing, wire
from gf_tf.checks import is_int_at_least
from gf_tf.plan import planner
from gf_tf.plan.planner import AUTO, DEFAULT_BYTES_PER_PACK, latency_bytes
from gf_tf.plan.records import TF_OWN, Costs, Forecast, Plan, Planned, PlanReport
from gf_tf.reducers.base import Reducer

__all__ = ["AUTO", "DEFAULT_BYTES_PER_PACK", "TF_OWN", "Costs", "Forecast", "Plan", "PlanReport",
           "Planned", "SetPlan", "Settings", "latency_bytes", "plan_set"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """A GradientFlowAllReduce's transport settings, checked once.

    compression: "auto" or a `gf_tf.wire.WireFormat` (given as one, or by its FORMATS name,
      None included).
    bytes_per_pack: "auto" or wire bytes >= 0. algorithm: "auto" or an ALGORITHMS name.
    overlap: "auto", True or False.

    Raises ValueError naming the bad setting and the values it takes.
    """
    compression: Union[str, wire.WireFormat] = AUTO
    bytes_per_pack: Union[str, int] = AUTO
    algorithm: str = AUTO
    overlap: Union[str, bool] = False

    def __post_init__(self):
        if not isinstance(self.compression, wire.WireFormat) and self.compression != AUTO:
            object.__setattr__(self, "compression", wire.get(self.compression))
        size = self.bytes_per_pack
        if size != AUTO:
            if not is_int_at_least(size, 0):
                raise ValueError(f"bytes_per_pack must be \"auto\" or an integer number of bytes "
                                 f">= 0, got {size!r}")
            object.__setattr__(self, "bytes_per_pack", int(size))
        if self.algorithm != AUTO:
            collectives.get(self.algorithm)
        planner.check_overlap(self.overlap)

    def method(self, reducer: Reducer) -> str:
        """The planner's method: "auto" (the reducer's default wire) or the pinned wire's."""
        if self.compression == AUTO:
            return reducer.default_method
        return self.compression.method


class SetPlan(NamedTuple):
    """What `plan_set` gives: the plan and its forecast, the signature it packs (every entry
    None for TF's own all-reduce) and its PackSpecs."""
    planned: Planned
    signature: Tuple
    pack_specs: Tuple[packing.PackSpec, ...]


def plan_set(signature: Sequence, settings: Settings, reducer: Reducer, workers: int,
             costs: Optional[Costs]) -> SetPlan:
    """The plan of a gradient signature (per gradient (shape, dtype), or None where it cannot
    be packed) under `settings`, for `reducer` over `workers` workers. The same on every
    worker given the same arguments."""
    packable = [entry for entry in signature if entry is not None]
    elements = sum(int(shape.num_elements()) for shape, _ in packable)
    method = settings.method(reducer)
    # A reducer with its own cost sends its packs in their own dtype under "auto".
    own_wire = wire.format_of(wire.NO_COMPRESSION if method == AUTO else method)
    terms = reducer.cost(elements, own_wire)
    if terms is None:
        planned = planner.choose(elements, len(packable), workers, costs, method,
                                 settings.algorithm, settings.bytes_per_pack, settings.overlap,
                                 reducer.wire_control)
    else:
        size = (DEFAULT_BYTES_PER_PACK if settings.bytes_per_pack == AUTO
                else settings.bytes_per_pack)
        algorithm = planner.choose_fixed_algorithm(terms, workers, costs, settings.algorithm)
        planned = Planned(Plan(own_wire.method, size, algorithm), Forecast())
    plan = planned.plan
    if plan.method == TF_OWN:
        signature, pack_specs = [None] * len(signature), ()   # every gradient by TF's own all-reduce
    else:
        pack_specs = packing.plan_packs(signature, plan.bytes_per_pack, plan.wire)
    live = sum(1 for p in pack_specs if p.num_elements)
    if terms is None:
        plan = planner.with_pack_count(plan, live, settings.overlap)
    else:
        plan = dataclasses.replace(plan, groups=planner.choose_fixed_groups(
            live, terms, workers, costs, plan.algorithm, settings.overlap))
    return SetPlan(Planned(plan, planned.forecast), tuple(signature), pack_specs)
