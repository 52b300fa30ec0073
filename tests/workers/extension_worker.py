"""One worker of tests/test_seams.py: a reducer, a wire format and a collective algorithm
defined here, outside gf_tf/, through its registries and its public reducer seam.

--extension values:
  reducer    `SendEverything`: a float32 reducer of our own (concatenate, all-reduce, split),
             passed as GradientFlowAllReduce(reducer=...)
  wire       "fp32_alias": float32 under another name, registered in gf_tf.wire.FORMATS and
             passed as compression="fp32_alias"
  algorithm  "ring_alias": the ring under another name, registered in
             gf_tf.collectives.ALGORITHMS and passed as algorithm="ring_alias" (FP16 packs)
Each worker all-reduces --steps steps of fresh random gradients (per worker, per step) of
VARIABLES with gf_tf.all_reduce_gradients and writes them (g{step}_{i}) with the results
(out{step}_{i}) and the dtypes of the traced step's collectives.
"""

import argparse

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--extension", required=True, choices=["reducer", "wire", "algorithm"])
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position
from gf_tf import collectives, reducers, wire  # pylint: disable=wrong-import-position

VARIABLES = [(7, 3), (1009,), (1,)]


class SendEverything(reducers.Reducer):
    """Every pack as float32, concatenated, in one all-reduce per pack, split back."""

    def settings(self):
        return [("send-everything version", 1, str)]

    def cost(self, elements, wire_format):
        return reducers.CostTerms((4 * elements,))

    def reduce(self, step):
        comm, outputs, sent = step.comm, [], reducers.Sent()
        for pack in step.packs:
            flat = comm.map(lambda r, g: tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1])
                                                    for t in g], 0), pack.grads)
            summed = comm.all_reduce_sum(flat)
            outputs.append(comm.map(lambda r, s: [
                tf.cast(tf.reshape(part, shape), dtype) * comm.postscale for part, shape, dtype in
                zip(tf.split(s, [int(np.prod(x)) for x in pack.spec.shapes]), pack.spec.shapes,
                    pack.spec.dtypes)], summed))
            sent = sent + reducers.Sent(4 * pack.spec.num_elements, 4 * pack.spec.num_elements)
        return outputs, sent


if args.extension == "reducer":
    gradient_flow = gf_tf.GradientFlowAllReduce(reducer=SendEverything())
elif args.extension == "wire":
    wire.register(wire.WireFormat("fp32_alias", tf.float32))
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp32_alias")
else:
    ring = collectives.ALGORITHMS[collectives.RING]
    collectives.register(collectives.Algorithm(
        "ring_alias", lambda context: context.tf_sum, ring.latency_units, ring.byte_factor,
        ring.same_as_tf_own))
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", algorithm="ring_alias")

strategy, step_fn = worker_util.gradient_step(gradient_flow, VARIABLES)


arrays = worker_util.random_steps(strategy, step_fn, VARIABLES, args.steps)
graph = step_fn.get_concrete_function([tf.TensorSpec(s, tf.float32) for s in VARIABLES]).graph
dtypes = [op.get_attr("T").name for op in graph.get_operations()
          if op.type.startswith("CollectiveReduce")]
for f in graph.as_graph_def().library.function:
    dtypes += [node.attr["T"].type for node in f.node_def if node.op.startswith("CollectiveReduce")]
arrays["collective_dtypes"] = np.array([tf.as_dtype(d).name if isinstance(d, int) else d
                                        for d in dtypes])
arrays["plans"] = np.array([report.describe() for report in gradient_flow.plans().values()])
worker_util.write_result(**arrays)
