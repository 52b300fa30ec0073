"""The trial: TensorFlow's own all-reduce against GradientFlow's wire, measured in a set's first steps.

The planner's cost model (`gf_tf.planner`) comes from a probe of a few
seconds, and its error on one all-reduce reaches 1.5-2x on shared cores. Where
its prediction cannot tell TensorFlow's own float32 all-reduce and the best
GradientFlow wire apart (`planner.TRIAL_BAND`), the step carries both behind a
`tf.switch_case` on a per-worker choice, and the set's first steps decide:

  steps 0, 1            each candidate once, untimed (first runs resolve their
                        collectives' groups and instances)
  steps 2 .. STEPS - 1  the candidates in turn, SAMPLES timed steps each:
                        seconds from the moment every gradient of the set is
                        ready to the moment every reduced tensor exists
  end of step STEPS - 1 each worker's median per candidate, SUM all-reduced
                        (one float32 [2] collective, once): every worker holds
                        the same means and keeps the same candidate. The
                        GradientFlow wire is kept only if its mean is below
                        KEEP_IF of TF's own: never slower than not installing us.

Cost: STEPS - 1 steps at most at the slower candidate, once per variable set;
after the decision, one switch_case and two clock reads per step. The choice
lives in the set's state (`gf_tf.state.VariableSetState.trial`): a retrace
keeps it, and nothing can change it afterwards. It is not checkpointed: a
restored run measures again.

Every worker issues the same collectives in the same order: the candidate of a
step is a function of the set's step counter and the all-reduced decision,
which are equal on every worker (the counters advance once per all-reduce of
the set, in lockstep, like CSC's).
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf import planner, tf_internal

TF_OWN, GRADIENT_FLOW = 0, 1    # the candidates' indices in the switch_case
UNTIMED = 2                      # steps 0 and 1: each candidate once
SAMPLES = 4                      # timed steps per candidate
STEPS = UNTIMED + 2 * SAMPLES    # the decision is taken at the end of step STEPS - 1
KEEP_IF = 0.95                   # GradientFlow's mean seconds must be below this share of TF's
UNDECIDED = -1


class TrialState(tf.Module):
    """One variable set's trial on this worker: plain local variables on the host.

    step: int64, all-reduces of the set so far (counted until the decision).
    seconds: float64 [2, SAMPLES], the timed steps' seconds, per candidate.
    choice: int32, TF_OWN or GRADIENT_FLOW once decided, else UNDECIDED.
    measured: float32 [2], the all-reduced mean of the workers' medians (TF's own,
      GradientFlow's), once decided.
    """

    def __init__(self, name: str):
        super().__init__(name=None)
        self.step = tf_internal.local_variable(tf.constant(0, tf.int64), "/cpu:0",
                                               f"gf_trial_step_{name}")
        self.seconds = tf_internal.local_variable(tf.zeros([2, SAMPLES], tf.float64), "/cpu:0",
                                                  f"gf_trial_seconds_{name}")
        self.choice = tf_internal.local_variable(tf.constant(UNDECIDED, tf.int32), "/cpu:0",
                                                 f"gf_trial_choice_{name}")
        self.measured = tf_internal.local_variable(tf.zeros([2], tf.float32), "/cpu:0",
                                                   f"gf_trial_measured_{name}")

    def decision(self) -> Tuple[Optional[int], Optional[Tuple[float, float]]]:
        """(the kept candidate, (TF's own, GradientFlow's) measured seconds), or (None, None)
        before the decision (eager)."""
        choice = int(self.choice.numpy())
        if choice == UNDECIDED:
            return None, None
        tf_s, gf_s = (float(x) for x in self.measured.numpy())
        return choice, (tf_s, gf_s)


def candidate_of_step(step: tf.Tensor, choice: tf.Tensor) -> tf.Tensor:
    """int32: the candidate a step runs (module docstring): the decision once taken; before
    it, step s runs candidate s mod 2 (TF's own on even steps)."""
    return tf.where(choice == UNDECIDED, tf.cast(step % 2, tf.int32), choice)


def keep(tf_seconds: tf.Tensor, gf_seconds: tf.Tensor) -> tf.Tensor:
    """int32: GRADIENT_FLOW if its seconds are positive and below KEEP_IF x TF's, else TF_OWN
    (also when a figure is not finite)."""
    faster = (gf_seconds > 0.0) & (gf_seconds < KEEP_IF * tf_seconds) & tf.math.is_finite(tf_seconds)
    return tf.where(faster, GRADIENT_FLOW, TF_OWN)


def median(samples: tf.Tensor) -> tf.Tensor:
    """Median of each row of `samples` [rows, n] (the mean of the middle two for even n)."""
    ordered = tf.sort(samples, axis=1)
    n = int(samples.shape[1])
    return (ordered[:, (n - 1) // 2] + ordered[:, n // 2]) / 2.0


def run(state: TrialState, candidates: Sequence[Callable[[], list]], inputs: Sequence[tf.Tensor],
        all_reduce_sum: Callable[[List[tf.Tensor]], List[tf.Tensor]], devices: Sequence[str],
        num_workers: int, set_name: str, clock: Callable[[], tf.Tensor] = tf.timestamp):
    """The step of a set under trial: (the candidate's outputs, int32 index of the candidate run).

    Args:
      state: the set's TrialState.
      candidates: [TF's own, GradientFlow's]: functions returning the same nest of tensors.
      inputs: the set's gradients on this worker (the clock starts once all exist).
      all_reduce_sum: SUM all-reduce, one 1-D float32 tensor per served replica (`devices`).
      num_workers: N workers (the decision averages their medians).
      clock: float64 seconds (tests replace it).
    """
    with tf.device("/cpu:0"):
        step, choice = state.step.read_value(), state.choice.read_value()
        which = candidate_of_step(step, choice)
        with tf.control_dependencies(list(inputs)):
            ready = clock()
    outputs = tf.switch_case(which, list(candidates))
    with tf.device("/cpu:0"):
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            done = clock()

        def record():
            sample = tf.cast((step - UNTIMED) // 2, tf.int32)
            state.seconds.scatter_nd_update([[which, sample]], tf.reshape(done - ready, [1]))
            return tf.constant(True)

        def decide():
            mine = tf.cast(median(state.seconds.read_value()), tf.float32)
            mean = all_reduce_sum(_on(devices, [mine if i == 0 else tf.zeros_like(mine)
                                                for i in range(len(devices))]))[0] / num_workers
            kept = keep(mean[TF_OWN], mean[GRADIENT_FLOW])
            with tf.device("/cpu:0"):
                state.measured.assign(mean)
                state.choice.assign(kept)
                tf.print(tf.strings.join([
                    f"gf_tf: variable set [{set_name}] measured ", _ms(mean[GRADIENT_FLOW]),
                    " ms per all-reduce with GradientFlow against ", _ms(mean[TF_OWN]),
                    " ms with TensorFlow's own (mean of the workers' medians): it travels as ",
                    tf.gather(["TensorFlow's own all-reduce", "GradientFlow"], kept)]))
            return tf.constant(True)

        def measure():   # only until the decision: afterwards one untaken cond per step
            tf.cond(step >= UNTIMED, record, lambda: tf.constant(False))
            tf.cond(step == STEPS - 1, decide, lambda: tf.constant(False))
            state.step.assign_add(1)
            return tf.constant(True)

        tf.cond(choice == UNDECIDED, measure, lambda: tf.constant(False))
    return outputs, which


def _ms(seconds: tf.Tensor) -> tf.Tensor:
    return tf.strings.as_string(1000.0 * seconds, precision=3)


def _on(devices: Sequence[str], tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Each tensor copied onto its device (the collective's per-replica inputs)."""
    out = []
    for device, t in zip(devices, tensors):
        with tf.device(device):
            out.append(tf.identity(t))
    return out


def sent_bytes(which: tf.Tensor, tf_bytes: int, gf_bytes: int) -> tf.Tensor:
    """int64: the bytes the step's candidate sent."""
    with tf.device("/cpu:0"):
        return tf.gather(tf.constant([tf_bytes, gf_bytes], tf.int64), which)


def effective_plan(transport: Optional[planner.Plan], state: Optional[TrialState]
                   ) -> Optional[planner.Plan]:
    """`transport`, or for a trial decided (read eagerly) the candidate kept, with the measured
    seconds: the GradientFlow wire, or TF's own float32 all-reduce."""
    if transport is None or not transport.trial or state is None or not tf.executing_eagerly():
        return transport
    choice, measured = state.decision()
    if choice is None:
        return transport
    if choice == GRADIENT_FLOW:
        return dataclasses.replace(transport, trial=False, measured=measured)
    return planner.Plan("tf", 0, planner.RING, transport.tf_seconds, measured=measured)


def steps_left(states: Sequence[Optional[TrialState]]) -> int:
    """Steps until the slowest undecided of `states` (None: no trial) decides; 0 if none (eager)."""
    return max([STEPS - int(s.step.numpy()) for s in states
                if s is not None and s.decision()[0] is None], default=0)
