"""The trial: TensorFlow's own all-reduce against GradientFlow's wire, timed when a set is first traced.

The planner's cost model (`gf_tf.plan.planner`) comes from a probe of a few
seconds, and its error on one all-reduce is large where worker processes share
cores (docs/planner.md). Where its prediction cannot tell TensorFlow's own
float32 all-reduce and the best GradientFlow wire apart (`planner.TIE`, `planner.MODEL_ERROR`),
the two are timed on the set's own shapes while its step is first traced,
eagerly (as the settings handshake runs, `gf_tf.agreement`), and the step is
traced with the one kept:

  each candidate UNTIMED times, untimed (first runs trace the candidate and
                  resolve its collectives' groups and instances)
  then SAMPLES    timed runs of each, in turn: wall seconds of one all-reduce
                  of tensors shaped like the set's gradients, on its devices
  then            each worker's median per candidate, SUM all-reduced (one
                  float64 [2] collective): every worker holds the same means and
                  keeps the same candidate. The GradientFlow wire is kept only if
                  its mean is below KEEP_IF of TF's own: never slower than not
                  installing us.
  early look      after FIRST_LOOK timed runs of each, the medians so far are
                  all-reduced the same way; where one candidate's mean is below
                  CLEAR of the other's, the trial ends there, with that one kept.
                  The runs it saves are the costly ones: a set large enough to be
                  bandwidth-bound, whose FP16 wire is near half TF's seconds.

Cost: (UNTIMED + SAMPLES) all-reduces by each candidate, or (UNTIMED + FIRST_LOOK)
when the early look is clear, once per variable set, while its step is traced.
The step itself carries only the kept candidate: nothing of the trial runs in
it (carrying both behind a `tf.switch_case` costs CPU time in every step). The
decision lives in the set's state (`gf_tf.state.VariableSetState.trial`): a
retrace keeps it, and nothing changes it afterwards. It is not checkpointed: a
restored run measures again. The trial's runs are not steps: the state of a reducer
(`gf_tf.reducers.Reducer.create_states`) is assigned back afterwards as it was before.

Every worker traces its step in the same order, so every worker runs the same
collectives in the same order here too.
"""

import dataclasses
import statistics
import sys
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from gf_tf import collectives
from gf_tf.plan import records

TF_OWN, GRADIENT_FLOW = 0, 1    # the candidates' indices
UNTIMED = 1                      # untimed runs of each candidate
SAMPLES = 5                      # timed runs of each candidate
KEEP_IF = 0.95                   # GradientFlow's mean seconds must be below this share of TF's
FIRST_LOOK = 2                   # timed runs of each before the early look
CLEAR = 0.6                      # the early look decides where one mean is below this share of the other's


@dataclasses.dataclass(frozen=True)
class Decision:
    """A set's trial, decided: `choice` (TF_OWN or GRADIENT_FLOW) and the mean over the
    workers of each worker's median seconds per all-reduce, TF's own and GradientFlow's."""
    choice: int
    tf_seconds: float
    gf_seconds: float


def keep(tf_seconds: float, gf_seconds: float) -> int:
    """GRADIENT_FLOW if its seconds are positive and below KEEP_IF x TF's, else TF_OWN (also
    when a figure is not finite)."""
    faster = 0.0 < gf_seconds < KEEP_IF * tf_seconds and np.isfinite(tf_seconds)
    return GRADIENT_FLOW if faster else TF_OWN


def clear(tf_seconds: float, gf_seconds: float) -> bool:
    """Whether the early look may decide: both figures positive and finite, and one below
    CLEAR x the other."""
    figures = np.array([tf_seconds, gf_seconds], np.float64)
    if not (np.all(np.isfinite(figures)) and np.all(figures > 0.0)):
        return False
    return gf_seconds < CLEAR * tf_seconds or tf_seconds < CLEAR * gf_seconds


def measure(candidates: Sequence[Callable[[], object]],
            all_reduce_mean: Callable[[np.ndarray], np.ndarray], set_name: str,
            clock: Callable[[], float] = time.perf_counter) -> Decision:
    """Times the candidates (module docstring) and decides, the same on every worker. Eager.
    Every worker ends at the same run: the early look is decided on all-reduced figures.

    Args:
      candidates: [TF's own, GradientFlow's]: each runs one all-reduce of the set's shapes
        and returns once its sums exist.
      all_reduce_mean: the mean over the workers of a float64 [2] array (a collective).
      set_name: the variable set, for the log line.
      clock: seconds (tests replace it).

    Raises:
      tf.errors.OpError: what the collectives raise (a peer lost: TF's error at the
        timeout).
    """
    for candidate in candidates:
        for _ in range(UNTIMED):
            candidate()
    seconds = [[] for _ in candidates]
    for runs in range(1, SAMPLES + 1):
        for mine, candidate in zip(seconds, candidates):
            start = clock()
            candidate()
            mine.append(clock() - start)
        if runs == FIRST_LOOK or runs == SAMPLES:
            tf_s, gf_s = (float(x) for x in all_reduce_mean(
                np.array([statistics.median(s) for s in seconds], np.float64)))
            if clear(tf_s, gf_s):
                break
    decision = Decision(keep(tf_s, gf_s), tf_s, gf_s)
    kept = "GradientFlow" if decision.choice == GRADIENT_FLOW else "TensorFlow's own all-reduce"
    print(f"gf_tf: variable set [{set_name}] measured {1e3 * gf_s:.3f} ms per all-reduce with "
          f"GradientFlow against {1e3 * tf_s:.3f} ms with TensorFlow's own (mean of the workers' "
          f"medians of {runs} runs): it travels as {kept}", file=sys.stderr, flush=True)
    return decision


def report(planned: Optional[records.Planned], decision: Optional[Decision]
           ) -> Optional[records.PlanReport]:
    """The PlanReport of `planned`: for a trial decided, the candidate kept (the GradientFlow
    wire, or TF's own float32 all-reduce) with the measured seconds."""
    if planned is None:
        return None
    plan, forecast = planned
    if not plan.trial or decision is None:
        return records.PlanReport(plan, forecast)
    measured: Tuple[float, float] = (decision.tf_seconds, decision.gf_seconds)
    if decision.choice == GRADIENT_FLOW:
        return records.PlanReport(dataclasses.replace(plan, trial=False), forecast, measured)
    return records.PlanReport(records.Plan(records.TF_OWN, 0, collectives.tf_own().name),
                              records.Forecast(forecast.tf_seconds), measured)
