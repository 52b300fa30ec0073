"""One worker of tests/test_lowrank.py's multi-worker test: gf_tf.reducers.LowRank(rank=2) on the
FP16 wire, one replica per worker, --steps steps of fresh random gradients (per worker, per step).

Writes per step the gradients (g{step}_{i}), the reduced values (out{step}_{i}) and the reducer's
state before the step (state{step}_{key}: Q's and this worker's residuals; absent at step 0,
whose state is created by the step's trace).
"""

import argparse

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position

VARIABLES = [(24, 16), (3, 3, 4, 8), (16,)]

gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0, algorithm="ring",
                                            reducer=gf_tf.reducers.LowRank(rank=2))
strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=worker_util.communication_options(),
                                            gradient_flow=gradient_flow)
rank = worker_util.task_index()
with tf.init_scope():
    variables = [tf.Variable(tf.zeros(shape), name=f"v{i}") for i, shape in enumerate(VARIABLES)]


@tf.function
def step_fn(grads):
    def replica(*g):
        g = [tf.identity(t) for t in g]
        return gf_tf.all_reduce_gradients(g, variables, options=worker_util.communication_options())
    return strategy.run(replica, args=tuple(grads))


arrays = {}
for step in range(args.steps):
    for variable_set in gradient_flow.states().values():   # one, from the first step on
        arrays.update({f"state{step}_{key}": v for key, v in variable_set.to_arrays().items()})
    rng = np.random.default_rng([step, rank])
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in VARIABLES]
    out = step_fn([tf.constant(g) for g in grads])
    for i, (g, o) in enumerate(zip(grads, out)):
        arrays[f"g{step}_{i}"] = g
        arrays[f"out{step}_{i}"] = strategy.experimental_local_results(o)[0].numpy()
worker_util.write_result(**arrays)
