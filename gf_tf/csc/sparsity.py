"""`ChunkSparsity`: the arguments of CSC a user passes, their defaults and the warm-up schedule.

Source: GradientFlow (arXiv 1902.06855), "coarse-grained sparse
communication"; momentum correction and warm-up as in Deep Gradient
Compression (Lin et al., arXiv 1712.01887, sections 3.2 and 3.4). The
algorithm of one step is described in `gf_tf.csc` (package doc).
"""

import math
from typing import Optional, Tuple, Union

from gf_tf.csc import policies
from gf_tf.csc.auto import AUTO, DEFAULT_AUTO_BUDGET, DEFAULT_MIN_DENSITY  # noqa: F401 (re-exported)
from gf_tf.checks import is_int_at_least, is_number_in
from gf_tf.csc.density import DensityRule
from gf_tf.csc.reducer import CSCReducer

# A fixed density loses accuracy where a pack has few chunks or compressing saves little (the
# time-to-accuracy matrix, docs/benchmarks.md); "auto" sends dense there.
DEFAULT_DENSITY = AUTO
"""`ChunkSparsity(density=)`: "auto", the density chosen each step (`AutoDensity`)."""

# DEFAULT_CHUNK_SIZE: the chunk norms add 4 bytes per chunk_size float32 elements (1/1024 of
# the dense bytes at 1024), a small share of what a sparse FP16 step sends, and smaller chunks
# select about the same share of the accumulator's L1 mass per step while their norms cost
# more.
DEFAULT_CHUNK_SIZE = 1024
"""`ChunkSparsity(chunk_size=)`: elements per chunk."""

WARMUP_MODES = ("dense", "exponential")
SELECTIONS = policies.BUILT_IN   # the built-in policies; policies.POLICIES holds all
# selection="ahead": what scores a chunk for the next step (`gf_tf.csc.ahead`).
SCORINGS = ("error_feedback", "paper")


class ChunkSparsity:
    """CSC settings, for `GradientFlowAllReduce(sparsity=...)`.

    Source: GradientFlow (arXiv 1902.06855), "coarse-grained sparse
    communication" (CSC): each pack is cut into chunks of `chunk_size`
    elements, and each step sends only the k chunks with the largest
    all-reduced L1 norms; what is not sent stays in a per-replica residual
    (error feedback). Momentum correction and warm-up follow Deep Gradient
    Compression (Lin et al., arXiv 1712.01887, sections 3.2 and 3.4).

    Args:
      density (float | str | DensityRule): "auto" (the default, DEFAULT_DENSITY): each step
        is dense or sparse as the measured link and the gradient's regime say (see
        "density="auto"" below; `gf_tf.csc.auto.AutoDensity`). Or a target fraction of chunks
        sent per step, in (0, 1]: k = max(1, ceil(density * num_chunks)) chunks of each pack
        are sent; 1.0 means dense (fewer than `gf_tf.csc.MIN_CHUNKS` a pack logs a warning). Or a
        `gf_tf.csc.density.DensityRule` object (its own settings; min_density
        and auto_budget then stay at their defaults).
      chunk_size (int): elements per chunk (>= 1). The chunk norms add 4
        bytes per chunk_size elements to each step (1/chunk_size of the
        float32 bytes).
      warmup_steps (int): number of all-reduce steps (optimizer steps) at the
        start that use the warm-up schedule instead of `density`.
      momentum (float): momentum correction factor m in [0, 1). With m > 0
        this object keeps the momentum u = m*u + g per replica and sends from
        residual + u, so the optimizer must be plain SGD WITHOUT momentum
        (e.g. `keras.optimizers.SGD(learning_rate, momentum=0.0)`) set to the
        learning rate you would use with momentum m (for a constant rate the
        dense steps then equal Keras's SGD with momentum m). With m = 0 it is
        plain error feedback and any optimizer can be used (momentum
        optimizers converge worse at low density: see DGC).
      warmup (str): the schedule during the first `warmup_steps` steps:

        - "dense": every pack is all-reduced densely (in the pack's wire dtype);
        - "exponential": the warm-up is cut into equal stages of density
          0.25, 0.25/4, 0.25/16, ... (those above `density`), as in DGC's
          25% -> 6.25% -> 1.5625% -> 0.4% ramp.

        See `schedule()` and `density_at(step)`. Momentum correction needs a warm-up of dense
        steps (DGC, section 3.4): without one, or with the exponential ramp
        from step 0, training with momentum > 0 can diverge (see
        docs/benchmarks.md). Plain error feedback (momentum=0) needs none.
      selection (str): which chunks compete for the k places:

        - "per_pack": each pack sends its own top k = max(1, ceil(density *
          C_p)) of its C_p chunks (every pack is represented every step);
        - "global": one top K = max(1, ceil(density * C)) over the C chunks of
          all packs of one wire dtype (the whole model in practice), the
          whole-model importance of GradientFlow's CSC; a pack may send none
          or all of its chunks on a step. Same bytes on the wire, same two
          collectives per step; ties go to the lower chunk index, counting
          through the packs in their all-reduce order;
        - "ahead": each pack sends its own top k, chosen at the previous step
          from all-reduced scores (GradientFlow's Algorithm 1): a sparse step
          issues ONE collective per group of packs (its chunks, with the
          scores and bound that choose and scale the next step's), so each
          group leaves as soon as its own gradients are ready. The last
          warm-up step chooses the first sparse step's chunks (the chunk L1
          norms of its dense all-reduced gradient). Needs a numeric density.
          See `gf_tf.csc.ahead` for the FP16 wire's scale and its float32
          retry.
        - the name of a policy registered with `gf_tf.csc.policies.register`.
      min_density (float): density="auto" only: the floor, in (0, 1]
        (default DEFAULT_MIN_DENSITY, 0.01). It bounds how
        stale a residual can get: at the floor every chunk can be sent within
        ceil(C / k) <= 1 / min_density steps (C chunks of a pack, k of them
        sent per step). Lower it only for runs much longer than
        1 / min_density steps: with fewer sparse steps than that, residuals
        go stale and the model trains worse (see docs/benchmarks.md).
      auto_budget (float): density="auto" only: communication seconds allowed
        per second of compute, > 0 (default 0.05). Both go to `AutoDensity`,
        which checks them and holds them (`min_density` and `auto_budget` read it).
      scoring (str): selection="ahead" only: the score that chooses the next
        step's chunks, all-reduced (SUM over replicas):

        - "error_feedback": the L1 norm of each chunk of what the next step
          will send from, as far as it is known: the residual (plus
          momentum * u with momentum correction);
        - "paper": GradientFlow's rule: a chunk just sent scores the L1 norm of
          its all-reduced sum, any other its residual's L1 norm.

    Raises:
      ValueError: an argument is out of range or of the wrong type (the
        message names it), selection="ahead" is given with density="auto", a
        scoring other than "error_feedback" is given without selection="ahead", or
        min_density / auto_budget are given beside a DensityRule object.

    density="auto": after the warm-up, each step picks one rung of `rungs()` (static k per
    pack per rung, at least `gf_tf.csc.MIN_CHUNKS` chunks of a pack, so the rungs are branches of one
    `tf.switch_case`; rung 1.0 is a dense step). It is dense while the gradient's L1 norm
    changes from one window of steps to the next (a critical regime, as Accordion detects
    it) and where a sparse rung would save less than a quarter of a dense step's predicted
    time; otherwise the largest density whose bytes, priced from the previous step's timing,
    cost at most `auto_budget` of the compute time (the link's fixed latency, measured by
    the planner's probe, is left out of the price). The figures ride in the step's control
    all-reduce so every replica picks the same rung (`gf_tf.csc.auto.AutoDensity`). The
    model, its sources and its measurements: docs/csc.md, section "density="auto"". The
    chosen density is `GradientFlowStats`' `gf_density`.

    Selection and density are objects (`policy`, `density_rule`): `selection` names one of
    `gf_tf.csc.policies.POLICIES` (docs/csc.md, "Adding a selection policy").

    State: this object holds settings only. The state (`CSCState`:
    residuals, velocities, step counters) belongs to the variables whose
    gradients it holds: GradientFlowAllReduce keeps one per variable set
    (see `GradientFlowAllReduce.states()`), so two models or two optimizers
    under one strategy never share it. The state is saved with the
    optimizer's checkpoint (`gf_tf.keras.checkpoint`: `model.save_weights`,
    `ModelCheckpoint`, `BackupAndRestore`), each worker its own; use
    `gf_tf.keras.backup.BackupAndRestore` with several workers.
    """

    def __init__(self, density: Union[float, str] = DEFAULT_DENSITY,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, warmup_steps: int = 0,
                 momentum: float = 0.0, warmup: str = "dense", selection: str = "per_pack",
                 min_density: float = DEFAULT_MIN_DENSITY,
                 auto_budget: float = DEFAULT_AUTO_BUDGET, scoring: str = "error_feedback"):
        if not is_int_at_least(chunk_size, 1):
            raise ValueError(f"chunk_size must be an int >= 1 (elements), got {chunk_size!r}")
        if not is_int_at_least(warmup_steps, 0):
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not is_number_in(momentum, 0.0, 1.0, high_open=True):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
        self.policy = policies.policy(selection)
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        if isinstance(density, DensityRule) and (min_density, auto_budget) != (
                DEFAULT_MIN_DENSITY, DEFAULT_AUTO_BUDGET):
            raise ValueError("min_density and auto_budget belong to density=\"auto\"; a density rule "
                             "object holds its own settings")
        self.density_rule = policies.density_rule(density, min_density=min_density,
                                                  budget=auto_budget)
        policies.check(self.policy, self.density_rule, scoring, SCORINGS[0])
        self.density = self.density_rule.value
        self.chunk_size = int(chunk_size)
        self.warmup_steps = int(warmup_steps)
        self.momentum = float(momentum)
        self.warmup = warmup
        self.selection = selection
        self.scoring = scoring

    @property
    def min_density(self) -> float:
        """The density rule's floor (`DensityRule.floor`; density="auto": `min_density`)."""
        return self.density_rule.floor

    @property
    def auto_budget(self) -> float:
        """density="auto"'s budget (`AutoDensity.budget`); DEFAULT_AUTO_BUDGET for other rules."""
        return getattr(self.density_rule, "budget", DEFAULT_AUTO_BUDGET)

    @property
    def auto(self) -> bool:
        """True for density="auto" (a density rule that times each step)."""
        return self.density_rule.measures

    @property
    def overlaps(self) -> bool:
        """Whether groups of packs may each select and send on their own (overlap with
        backprop): both the policy and the density rule allow it (`groupable`): per-pack
        selection (or "ahead") at a fixed density. selection="global" needs every pack's
        norms and density="auto" the whole step's timing: one barrier."""
        return self.policy.groupable and self.density_rule.groupable

    def rungs(self) -> Tuple[float, ...]:
        """The densities density="auto" chooses from, largest first.

        AUTO_LADDER's entries above `min_density`, then `min_density` (the
        floor, always the last rung). For a numeric density: (density,).
        """
        return self.density_rule.rungs()

    def __repr__(self):
        return f"ChunkSparsity({', '.join(f'{key}={value!r}' for key, value in self.get_config().items())})"

    # -- schedule ----------------------------------------------------------

    def schedule(self) -> Tuple[Tuple[int, Union[float, str]], ...]:
        """The density schedule as ((first_step, density), ...).

        first_step ascending from 0, density non-increasing; a stage lasts
        until the next one's first_step, the last one forever; density 1.0
        is a dense step. Examples (density=0.001, warmup_steps=400):
        "dense": ((0, 1.0), (400, 0.001));
        "exponential": ((0, 0.25), (100, 0.0625), (200, 0.015625),
        (300, 0.00390625), (400, 0.001)).
        With density="auto" the last stage's density is "auto" (chosen each
        step among `rungs()`), and the exponential ramp stops above
        `min_density`.
        """
        if self.warmup_steps == 0:
            return ((0, self.density),)
        target = self.density_rule.floor
        if self.warmup == "dense":
            ramp = [1.0] if target < 1.0 else []
        else:
            ramp = []
            d = 0.25
            while d > target:
                ramp.append(d)
                d /= 4
        stages = [(i * self.warmup_steps // len(ramp), d) for i, d in enumerate(ramp)]
        stages.append((self.warmup_steps, self.density))
        # Stages shorter than one step (warmup_steps < len(ramp)) vanish.
        return tuple(s for s, nxt in zip(stages, stages[1:] + [None])
                     if nxt is None or nxt[0] > s[0])

    def density_at(self, step: int) -> Union[float, str]:
        """Density of all-reduce step `step` (0-based) under `schedule()` ("auto" after an auto warm-up)."""
        current = self.density
        for first_step, density in self.schedule():
            if step >= first_step:
                current = density
        return current

    def candidates(self) -> Tuple[Tuple[Optional[int], float], ...]:
        """The densities a step may run at, as ((first_step or None, density), ...):
        the numeric stages of `schedule()`, then the density rule's `candidates()`
        (density="auto": every rung, with first_step None)."""
        stages = tuple((s, d) for s, d in self.schedule() if not isinstance(d, str))
        return stages + self.density_rule.candidates()

    def step_bytes(self, elements: int, wire_bytes: int = 2) -> Tuple[int, ...]:
        """Bytes per worker of each collective of one sparse step over `elements` gradient
        elements in one pack, at the final density (density="auto": its floor), on a wire of
        `wire_bytes` bytes per element (FP16: 2), for the planner (`CSCReducer.cost`): the
        policy's `step_bytes`, e.g. (chunk norms, selected chunks), or with selection="ahead"
        (selected chunks + the next step's scores and bound,)."""
        chunks = math.ceil(elements / self.chunk_size)
        return self.policy.step_bytes(chunks, self.chunk_size, self.density_rule.floor, wire_bytes)

    def reducer(self) -> CSCReducer:
        """The reducer GradientFlowAllReduce runs each variable set's packs through."""
        return CSCReducer(self)

    def get_config(self) -> dict:
        """The constructor arguments (also compared across workers by GradientFlowAllReduce)."""
        return {"density": self.density, "chunk_size": self.chunk_size,
                "warmup_steps": self.warmup_steps, "momentum": self.momentum,
                "warmup": self.warmup, "selection": self.selection,
                **self.policy.config(self), **self.density_rule.config()}
