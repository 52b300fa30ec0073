"""CSC density rules: how a step's density is chosen after the warm-up.

A rule is what `ChunkSparsity(density=...)` holds: a `DensityRule`. `FixedDensity` serves a
fraction and `gf_tf.csc.auto.AutoDensity` "auto" (`gf_tf.csc.policies.density_rule` builds
one from the argument; a rule object of your own is passed as it is). Each rule holds and
checks its own parameters. `CSCReducer` asks the rule for the step's control figures, its
clocks and the candidate index, and never tests which rule it holds.
"""

from typing import Optional, Sequence, Tuple

from gf_tf.checks import is_number_in
from gf_tf.reducers import no_control

# Below a handful of chunks a step, each chunk waits many steps for its turn and a small
# model trains worse (mnist1d's 8 chunks at one a step: -9 points, docs/csc.md), while the
# bytes saved are a few tens of KB at most.
MIN_CHUNKS = 8
"""The fewest chunks of a pack a sparse step of density="auto" sends (`AutoDensity(min_chunks=)`);
a fixed density that sends fewer logs a warning."""


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
      min_chunks (int): the fewest chunks of a pack its own candidates send per step (1: no
        more than the density asks).

    A rule whose `value` is a name (not a fraction) gives its densities as `candidates()`
    (first_step None) and picks one in `index`, as `AutoDensity` does; the schedule's
    numeric warm-up stages come first.
    """
    value = None
    floor = 1.0
    code = 1.0
    measures = False
    groupable = True
    min_chunks = 1

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

    def index(self, stage, current, plans, timing, comm, warmup_steps: int, shared):
        """int32 index of the step's candidate plan: the schedule's `stage`. `timing` is the
        first served replica's all-reduced figures, `shared` the set's `CSCSetState`."""
        del current, plans, timing, comm, warmup_steps, shared
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
        if not is_number_in(density, 0.0, 1.0, low_open=True):
            raise ValueError(f"density must be a fraction in (0, 1] or \"auto\", got {density!r}")
        self.value = self.floor = self.code = float(density)
