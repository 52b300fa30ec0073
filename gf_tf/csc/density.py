"""CSC density rules: how a step's density is chosen after the warm-up.

A rule is what `ChunkSparsity(density=...)` holds: a `DensityRule`. `FixedDensity` serves a
fraction and `gf_tf.csc.auto.AutoDensity` "auto" (`gf_tf.csc.policies.density_rule` builds
one from the argument; a rule object of your own is passed as it is). Each rule holds and
checks its own parameters. `CSCReducer` asks the rule for the step's control figures, its
clocks and the candidate index, and never tests which rule it holds.
"""

from typing import Optional, Sequence, Tuple

from gf_tf.reducers import no_control

# The sparsest fixed density that trains models.train's digits CNN as well as dense float32
# (benchmarks/csc_defaults.py, benchmarks/convergence.py; the figures are in docs/benchmarks.md).
DEFAULT_DENSITY = 0.01
"""`ChunkSparsity(density=)`: fraction of each pack's chunks sent per step."""


class DensityRule:
    """The base of a CSC density rule. The defaults are those of a rule that keeps one density
    and measures nothing (`FixedDensity`); a rule overrides what it changes.

    Attributes:
      value (float | str): the density as `ChunkSparsity.density` shows it (a fraction, or the
        rule's name, e.g. "auto").
      floor (float): the sparsest density the rule takes, in (0, 1] (the warm-up ramp's target
        and the density the planner prices).
      code (float): the rule as the settings handshake compares it across workers.
      measures (bool): the rule needs the step's timing in the control all-reduce.
      groupable (bool): groups of packs may each choose on their own (overlap).

    A rule whose `value` is a name (not a fraction) gives its densities as `candidates()`
    (first_step None) and picks one in `index`, as `AutoDensity` does; the schedule's
    numeric warm-up stages come first.
    """
    value = None
    floor = 1.0
    code = 1.0
    measures = False
    groupable = True

    def rungs(self) -> Tuple[float, ...]:
        """The densities a sparse step may take, largest first: (floor,)."""
        return (self.floor,)

    def candidates(self) -> Tuple[Tuple[Optional[int], float], ...]:
        """Candidates beyond the schedule's numeric stages: none."""
        return ()

    def config(self) -> dict:
        """Settings this rule adds to `ChunkSparsity.get_config`: none."""
        return {}

    def figures(self, shared, clock, grads, comm):
        """Per served replica the rule's control figures: float32 [0]."""
        del shared, clock, grads
        return no_control(comm)

    def index(self, stage, current, plans, timing, comm, warmup_steps: int):
        """int32 index of the step's candidate plan: the schedule's `stage`."""
        del current, plans, timing, comm, warmup_steps
        return stage

    def clocked(self, buffers: Sequence, clock, comm):
        """(buffers, no "send" clocks): nothing is timed."""
        del clock, comm
        return buffers, []

    def done_clocks(self, reduced, clock, comm) -> list:
        """No "done" clocks."""
        del reduced, clock, comm
        return []

    def record(self, shared, comm, branch) -> None:
        """Nothing to keep for the next step."""
        del shared, comm, branch


class FixedDensity(DensityRule):
    """density=<fraction in (0, 1]>: every step after the warm-up at that density.

    Args:
      density (float): the fraction of each pack's chunks sent per step, in (0, 1]; it is
        `value`, `floor` and `code`.

    Raises:
      ValueError: density is not a number in (0, 1].
    """

    def __init__(self, density: float):
        if isinstance(density, bool) or not (isinstance(density, (int, float))
                                               and 0.0 < density <= 1.0):
            raise ValueError(f"density must be a fraction in (0, 1] or \"auto\", got {density!r}")
        self.value = self.floor = self.code = float(density)
