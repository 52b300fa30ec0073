"""One worker of the planner tests: the default GradientFlowAllReduce (the planner) all-reduces
two variable sets of this worker's random gradients; this worker's local timings are made to
differ from the others' (--skew), so the test sees that the plans agree anyway.

Writes the measured costs, each set's plan, the gradients it sent and the sums it received.
"""

import argparse

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--skew", type=float, default=3.0, help="local timings x (1 + skew * rank)")
parser.add_argument("--sizes", default="7,1009,1", help="elements of the small set's tensors")
parser.add_argument("--large", type=int, default=300_000, help="elements of the large set")
args = parser.parse_args()

import gf_tf  # after argparse
from gf_tf.plan import probe

rank = worker_util.task_index()
measured = probe.local_seconds


def skewed(wire_format, device):
    return measured(wire_format, device) * (1 + args.skew * rank)


probe.local_seconds = skewed

strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=worker_util.communication_options())
gfar = strategy.gradient_flow
rng = np.random.default_rng()   # fresh inputs every run
sets = {"small": [rng.normal(size=(n,)).astype(np.float32) for n in map(int, args.sizes.split(","))],
        "large": [rng.normal(size=(args.large,)).astype(np.float32)]}
with strategy.scope():
    variables = {name: [tf.Variable(tf.zeros(g.shape), name=f"{name}{i}") for i, g in enumerate(grads)]
                 for name, grads in sets.items()}


@tf.function
def step():
    def fn():
        return {name: gf_tf.all_reduce_gradients([tf.constant(g) for g in sets[name]], variables[name])
                for name in sets}
    return strategy.run(fn)


out = step()
costs = gfar.costs   # the ring's hop latency first, then every other figure
result = {"costs": np.array([costs.latency_s["ring"]]
                            + [v for k, v in costs.latency_s.items() if k != "ring"]
                            + [costs.byte_s] + list(costs.local_s.values()))}
for name in sets:
    for i, (sent, got) in enumerate(zip(sets[name], out[name])):
        result[f"{name}_sent{i}"] = sent
        result[f"{name}_sum{i}"] = strategy.experimental_local_results(got)[0].numpy()
plans = list(gfar.plans().values())
result["plans"] = np.array([f"{p.plan.method} {p.plan.bytes_per_pack} {p.plan.algorithm}"
                            for p in plans])
result["seconds"] = np.array([p.forecast.seconds for p in plans])
worker_util.write_result(**result)
