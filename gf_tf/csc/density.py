"""CSC density rules: how a step's density is chosen after the warm-up.

A rule is what `ChunkSparsity(density=...)` holds: `FixedDensity` for a fraction, and
`gf_tf.csc.auto.AutoDensity` for "auto" (`gf_tf.csc.policies.density_rule` picks one).
`CSCReducer` asks the rule for the step's control figures, its clocks and the candidate
index, and never tests which rule it holds.
"""

from typing import Optional, Sequence, Tuple

from gf_tf.reducers import no_control


class FixedDensity:
    """density=<fraction in (0, 1]>: every step after the warm-up at that density.

    Attributes:
      value (float): the density, as `ChunkSparsity.density` shows it.
      floor (float): the sparsest density the rule takes (the warm-up ramp's target and the
        density the planner prices): the density itself.
      code (float): the density as the settings handshake compares it across workers.
      measures (bool): the rule needs the step's timing in the control all-reduce (False).
      groupable (bool): groups of packs may each choose on their own (True).
    """
    measures = False
    groupable = True

    def __init__(self, density: float):
        self.value = self.floor = self.code = float(density)

    def rungs(self) -> Tuple[float, ...]:
        """The densities a sparse step may take: (density,)."""
        return (self.value,)

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
