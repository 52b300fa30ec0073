"""One worker of tests/test_lowrank.py's multi-worker test: gf_tf.reducers.LowRank(rank=2) on the
FP16 wire, one replica per worker, --steps steps of fresh random gradients (per worker, per step).

Writes per step the gradients (g{step}_{i}), the reduced values (out{step}_{i}) and the reducer's
state before the step (state{step}_{key}: Q's and this worker's residuals; absent at step 0,
whose state is created by the step's trace).
"""

import argparse

import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position

VARIABLES = [(24, 16), (3, 3, 4, 8), (16,)]

gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0, algorithm="ring",
                                            reducer=gf_tf.reducers.LowRank(rank=2, warmup_steps=0))
strategy, step_fn = worker_util.gradient_step(gradient_flow, VARIABLES)




def state_before(step):   # one variable set, from the first step on
    return {f"state{step}_{key}": value for variable_set in gradient_flow.states().values()
            for key, value in variable_set.to_arrays().items()}


arrays = worker_util.random_steps(strategy, step_fn, VARIABLES, args.steps, state_before)
worker_util.write_result(**arrays)
