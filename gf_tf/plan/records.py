"""The planner's records: its measured constants (`Costs`), its decision for one variable set
(`Plan`), what it predicts of it (`Forecast`, `Planned`) and how people read it (`PlanReport`).

Plain data, made by `gf_tf.plan.planner` and `gf_tf.plan.probe`, read by the route, the trial,
the checkpoint and the benchmarks; re-exported by `gf_tf.plan`.
"""

import dataclasses
from typing import Mapping, NamedTuple, Optional, Tuple

from gf_tf import wire

TF_OWN = "tf"   # Plan.method of TensorFlow's own float32 batch all-reduce


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured constants of the model (`gf_tf.plan.probe`), in seconds.

    The mean over the workers, so every worker plans from the same numbers.

    Attributes:
      byte_s: beta, wire seconds of one payload byte on one link.
      latency_s: per algorithm name (`gf_tf.collectives.ALGORITHMS`), its latency
        unit in seconds (the ring: one hop; recursive doubling: one round).
      local_s: per wire method name (`gf_tf.wire.WireFormat.method`: "none", "fp16",
        "bf16", ...), local seconds per float32 element of its pack + unpack (scaled
        wires: with max |g| and the scaling). "none" is also TF's own concat + split.
    """
    byte_s: float
    latency_s: Mapping[str, float]
    local_s: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision for one variable set's float32/float16/bfloat16 gradients.

    Attributes:
      method: "tf" (the wrapped TF cross-device ops' own float32 batch all-reduce,
        gf_tf sends nothing itself) or a wire format's method name (`gf_tf.wire`:
        "fp16", "bf16", "none" for packs in their own dtype, ...).
      bytes_per_pack: pack threshold in wire bytes (0: one pack per dtype).
      algorithm: a `gf_tf.collectives.ALGORITHMS` name.
      groups: consecutive groups the packs are cut into, each with its own control
        collective (1: one barrier, every pack waits for the step's last gradient;
        `gf_tf.reducers.for_each_group`).
      trial: this GradientFlow wire is timed against TensorFlow's own float32
        all-reduce when the set is first traced and the faster is kept
        (`gf_tf.plan.trial`).
    """
    method: str
    bytes_per_pack: int
    algorithm: str
    groups: int = 1
    trial: bool = False

    @property
    def wire(self) -> Optional[wire.WireFormat]:
        """The `gf_tf.wire.WireFormat` float32 packs travel on; None for TF's own all-reduce."""
        return None if self.method == TF_OWN else wire.format_of(self.method)

    @property
    def scaled(self) -> bool:
        """Its wire needs all-reduced scale bounds before its packs (`gf_tf.wire`)."""
        return self.method != TF_OWN and self.wire.scaled


@dataclasses.dataclass(frozen=True)
class Forecast:
    """What the model predicts of a plan, in seconds (None: not modelled, e.g. one worker or
    settings pinned without measurements).

    Attributes:
      seconds: the step's all-reduce when nothing hides behind backprop.
      last_seconds: with groups > 1, the last group alone (what is left after
        backprop at best).
      tf_seconds: for a trial plan, TF's own all-reduce's.
    """
    seconds: Optional[float] = None
    last_seconds: Optional[float] = None
    tf_seconds: Optional[float] = None


class Planned(NamedTuple):
    """A plan and its forecast."""
    plan: Plan
    forecast: Forecast


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """How a variable set travels, for people (`GradientFlowAllReduce.plans()`).

    Attributes:
      plan: the `Plan`; for a trial that has decided, the candidate kept.
      forecast: the model's `Forecast` of it.
      measured: once a trial has decided, (TF's own, the GradientFlow wire's)
        measured seconds per all-reduce (the mean over workers of each worker's
        median); else None.
    """
    plan: Plan
    forecast: Forecast = Forecast()
    measured: Optional[Tuple[float, float]] = None

    @property
    def steady_seconds(self) -> Optional[float]:
        """Predicted seconds once any trial has decided: the lesser of the two for a trial plan."""
        seconds, tf_seconds = self.forecast.seconds, self.forecast.tf_seconds
        if self.plan.trial and seconds is not None and tf_seconds is not None:
            return min(seconds, tf_seconds)
        return seconds

    def describe(self) -> str:
        """One line for a log: the plan, its predicted and (after a trial) measured seconds."""
        plan, forecast = self.plan, self.forecast
        if plan.method == TF_OWN:
            what = "TensorFlow's own float32 all-reduce"
        else:
            packs = "one pack per dtype" if not plan.bytes_per_pack else \
                f"packs of {plan.bytes_per_pack} bytes"
            name = "float32" if plan.wire.name is None else plan.method
            what = f"{name} packs ({packs}), {plan.algorithm.replace('_', ' ')}"
            what += f", {plan.groups} groups overlapped with backprop" if plan.groups > 1 \
                else ", one barrier" if plan.scaled else ""
        if plan.trial:
            what = (f"{what}, or TensorFlow's own float32 all-reduce, whichever measures faster "
                    f"at the first trace")
        if forecast.seconds is not None:
            what = f"{what}, predicted {1000 * forecast.seconds:.2f} ms per step"
            if plan.trial and forecast.tf_seconds is not None:
                what = f"{what} against {1000 * forecast.tf_seconds:.2f} ms"
            if forecast.last_seconds is not None:
                what = f"{what} ({1000 * forecast.last_seconds:.2f} ms after the last gradient at best)"
        if self.measured is not None:
            tf_s, gf_s = self.measured
            what = (f"{what}; measured {1000 * gf_s:.2f} ms (GradientFlow) against "
                    f"{1000 * tf_s:.2f} ms (TensorFlow's own)")
        return what
