"""CSC state of one variable set on this worker: plain (not mirrored) local variables.

`CSCSetState` is the set's (one step counter per local replica; the
density="auto" timing), `CSCState` each pack's (residuals, velocities).
GradientFlowAllReduce keeps them in the set's `gf_tf.state.VariableSetState`;
each turns itself into arrays and back (`to_arrays`, `assign_arrays`), so a
checkpoint never needs to know their fields.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.csc.auto import REGIME_KEY, AutoState


class CSCSetState(tf.Module):
    """The state of a variable set that its packs share.

    steps: per local replica, int64 scalar on the host: all-reduce steps run.
    auto: the density="auto" state (`gf_tf.csc.auto.AutoState`), else None.
    optional_keys: the arrays a checkpoint may have or lack (the auto regime, so a
      checkpoint restores across density rules).
    """
    optional_keys = (REGIME_KEY,)

    def __init__(self, name: str, num_replicas: int, timing: bool):
        super().__init__(name=None)
        self.steps = [tf_internal.local_variable(tf.constant(0, tf.int64), "/cpu:0",
                                                 f"gf_step_{name}_r{r}")
                      for r in range(num_replicas)]
        self.auto = AutoState(name, num_replicas) if timing else None

    def to_arrays(self) -> Dict[str, np.ndarray]:
        """The auto state's arrays (`AutoState.to_arrays`; none without auto). The step
        counters are saved by every pack (`CSCState.to_arrays`), as checkpoint format 1 has them."""
        return self.auto.to_arrays() if self.auto is not None else {}

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """`to_arrays` as tensors read from the variables."""
        return self.auto.to_tensors() if self.auto is not None else {}

    def assign_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        if self.auto is not None:
            self.auto.assign_arrays(arrays)


class CSCState(tf.Module):
    """CSC state of one pack on this worker.

    residuals: per local replica, float32 [n] on the replica's device.
    velocities: per local replica, float32 [n] (momentum > 0), else None.
    residual_l1: float32 scalar: L1 norm of local replica 0's residual.
    steps: the variable set's step counters (`CSCSetState.steps`, shared by its packs).
    scores, bounds: selection="ahead" only (else None), per local replica on its device:
      float32 [C], the all-reduced scores that choose the next step's chunks, and a float32
      scalar, the all-reduced bound that scales them onto an FP16 wire (0: none yet);
      equal on every replica of every worker (`gf_tf.csc.ahead`).
    """

    def __init__(self, name: str, num_elements: int, devices: Sequence[str], momentum: bool,
                 steps: List[tf.Variable], num_chunks: Optional[int] = None):
        super().__init__(name=None)
        n = num_elements
        self.steps = steps
        self.residuals = [tf_internal.local_variable(tf.zeros([n], tf.float32), d,
                                                     f"gf_residual_{name}_r{r}")
                          for r, d in enumerate(devices)]
        self.velocities: Optional[List[tf.Variable]] = None
        if momentum:
            self.velocities = [tf_internal.local_variable(tf.zeros([n], tf.float32), d,
                                                          f"gf_velocity_{name}_r{r}")
                               for r, d in enumerate(devices)]
        self.residual_l1 = tf_internal.local_variable(tf.constant(0.0), "/cpu:0",
                                                      f"gf_residual_l1_{name}")
        self.scores: Optional[List[tf.Variable]] = None
        self.bounds: Optional[List[tf.Variable]] = None
        if num_chunks is not None:
            self.scores = [tf_internal.local_variable(tf.zeros([num_chunks], tf.float32), d,
                                                      f"gf_scores_{name}_r{r}")
                           for r, d in enumerate(devices)]
            self.bounds = [tf_internal.local_variable(tf.constant(0.0), d, f"gf_bound_{name}_r{r}")
                           for r, d in enumerate(devices)]

    @property
    def step(self) -> tf.Variable:
        """Local replica 0's step counter (the variable set's)."""
        return self.steps[0]

    def _variables(self) -> Dict[str, tf.Variable]:
        """Every saved variable by its array key: per replica r "step_r{r}" (the set's
        counter), "residual_r{r}", "velocity_r{r}" (momentum only), "scores_r{r}" and
        "bound_r{r}" (selection="ahead" only), then "residual_l1"."""
        named = {}
        for r, residual in enumerate(self.residuals):
            named[f"step_r{r}"] = self.steps[r]
            named[f"residual_r{r}"] = residual
            if self.velocities:
                named[f"velocity_r{r}"] = self.velocities[r]
            if self.scores:
                named[f"scores_r{r}"] = self.scores[r]
                named[f"bound_r{r}"] = self.bounds[r]
        named["residual_l1"] = self.residual_l1
        return named

    def to_arrays(self) -> Dict[str, np.ndarray]:
        """This pack's state as arrays (eager): int64 scalars, float32 [n] and a float32 scalar."""
        return {key: variable.numpy() for key, variable in self._variables().items()}

    def to_tensors(self) -> Dict[str, tf.Tensor]:
        """The keys and values of `to_arrays` as tensors read from the variables (eager or in a graph)."""
        return {key: variable.read_value() for key, variable in self._variables().items()}

    def assign_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        """Assigns what `to_arrays` gave (keys and shapes checked by the caller)."""
        for key, variable in self._variables().items():
            variable.assign(arrays[key])
