"""One worker of tests/test_collectives.py: gf_tf.collectives.recursive_doubling.recursive_doubling_sum
across processes.

--mode values: random inputs of every CASE (dtype, size), fresh per call, through recursive
  doubling eagerly (call 0) and in one tf.function called twice (calls 1, 2), where every
  recursive-doubling all-reduce is interleaved with a TF ring all-reduce of the same input
  (so TF's own instance keys must stay matched). Writes per call and case the input (x...)
  and both results (rd..., ring...) as float32 (exact for float16/bfloat16).
--mode gradients: gf_tf.all_reduce_gradients through a GradientFlowAllReduce(compression="fp16",
  algorithm=--algorithm, CSC with --density/--chunk_size if --density > 0) over VARIABLES, --steps
  steps of fresh gradients (chunk scales shared by all workers, so the top chunks are well
  separated); writes per step the gradients (g{step}_{i}), results (out{step}_{i}) and the
  float32 retries so far (retries{step}, `gf_tf.reducers.dense`), and the (op type, group size)
  of every collective of the traced step.
--mode fault: worker --victim exits (--stall: sleeps for 4 collective timeouts, alive, then
  exits) after --steps good all-reduces; the others keep calling and write the error they get
  ("error", "error_seconds").
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--mode", default="values", choices=["values", "gradients", "fault"])
parser.add_argument("--algorithm", default="recursive_doubling")
parser.add_argument("--density", type=float, default=0.0)
parser.add_argument("--chunk_size", type=int, default=16)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--selection", default="per_pack")
parser.add_argument("--warmup_steps", type=int, default=0)
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--stall", action="store_true")
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position
from gf_tf import cluster, tf_internal  # pylint: disable=wrong-import-position
from gf_tf.collectives import recursive_doubling  # pylint: disable=wrong-import-position

CASES = [(dtype, size) for dtype in ("float16", "bfloat16", "float32") for size in (1, 7, 1009, 0)]
SCALE = {"float16": 8.0, "bfloat16": 1e30, "float32": 1e-20}   # well inside each dtype's range

VARIABLES = [(7, 3), (1009,)]   # one pack of 1030 elements

gradient_flow = None
if args.mode == "gradients":
    gradient_flow = gf_tf.GradientFlowAllReduce(
        compression="fp16", algorithm=args.algorithm,
        sparsity=gf_tf.ChunkSparsity(density=args.density, chunk_size=args.chunk_size,
                                     warmup_steps=args.warmup_steps, selection=args.selection)
        if args.density else None)
strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=worker_util.communication_options(),
                                            gradient_flow=gradient_flow)
workers = cluster.from_tf_config().worker_info()
device = strategy.extended.worker_devices[0]
if gradient_flow is None:
    ring_ops = tf_internal.cross_device_ops_of(strategy)   # TF's CollectiveAllReduce
    rd_sum = recursive_doubling.recursive_doubling_sum(ring_ops, workers, [device],
                                                       worker_util.communication_options())


def ring_sum(t):
    pr = tf_internal.per_replica([t])
    reduced = ring_ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(pr, pr)],
                                    worker_util.communication_options())[0]
    return tf_internal.local_values(reduced)[0]


def inputs(call):
    out = []
    for c, (dtype, size) in enumerate(CASES):
        rng = np.random.default_rng([call, c, workers.rank])
        with tf.device(device):
            out.append(tf.cast(rng.standard_normal(size) * SCALE[dtype], dtype))
    return out


def both(xs):
    rd, ring = [], []
    for x in xs:
        rd.append(rd_sum([x])[0])
        ring.append(ring_sum(x) if x.shape[0] else tf.zeros_like(x))   # (no ring of 0 elements)
    return rd, ring


def values():
    results = {}
    function = tf.function(both)
    for call in range(3):
        xs = inputs(call)
        rd, ring = both(xs) if call == 0 else function(xs)
        for c, (x, a, b) in enumerate(zip(xs, rd, ring)):
            assert a.dtype == x.dtype and a.shape == x.shape and a.device == x.device, (a, x)
            for name, t in (("x", x), ("rd", a), ("ring", b)):
                results[f"{name}{call}_{c}"] = tf.cast(t, tf.float32).numpy()
    worker_util.write_result(**results)


def gradients():
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in VARIABLES]

    @tf.function
    def step(grads):
        return strategy.run(lambda: gf_tf.all_reduce_gradients([tf.identity(g) for g in grads],
                                                               variables))
    results = {}
    for s in range(args.steps):
        size = sum(int(np.prod(shape)) for shape in VARIABLES)
        chunk_scale = np.random.default_rng([s]).permutation(
            np.repeat(np.linspace(0.1, 10.0, -(-size // args.chunk_size)), args.chunk_size)[:size])
        parts = np.split(chunk_scale, np.cumsum([int(np.prod(shape)) for shape in VARIABLES])[:-1])
        rng = np.random.default_rng([s, workers.rank])
        grads = [tf.constant((rng.standard_normal(shape) * p.reshape(shape)).astype(np.float32))
                 for shape, p in zip(VARIABLES, parts)]
        for i, (g, out) in enumerate(zip(grads, step(grads))):
            results[f"g{s}_{i}"], results[f"out{s}_{i}"] = g.numpy(), out.numpy()
        results[f"retries{s}"] = gradient_flow.stats.totals().get("figure_float32_retries", 0.0)
    graph = step.get_concrete_function(grads).graph
    group_size_input = {"CollectiveReduceV2": 1, "CollectiveBcastSendV2": 1, "CollectiveBcastRecvV2": 0}
    collectives_found = [
        f"{op.type}:{tf.get_static_value(op.inputs[group_size_input[op.type]])}"
        if op.type in group_size_input else op.type
        for op in worker_util.nested_ops(graph) if op.type.startswith("Collective")]
    worker_util.write_result(collectives=np.array(collectives_found), **results)


def fault():
    step = tf.function(lambda x: rd_sum([x])[0])
    with tf.device(device):
        x = tf.ones([7], tf.float32)
    for _ in range(args.steps):
        step(x).numpy()
    if workers.rank == args.victim:
        if args.stall:   # alive (heartbeats go on), but issues no collective
            time.sleep(4 * worker_util.comm_timeout())
        os._exit(0)   # gone without a goodbye, as a crashed worker
    start = time.monotonic()
    try:
        for _ in range(1000):
            step(x).numpy()
        error = ""
    except Exception as e:  # pylint: disable=broad-except
        error = f"{type(e).__name__}: {str(e)[:300]}"
    worker_util.write_result(error=error, error_seconds=time.monotonic() - start)


{"values": values, "gradients": gradients, "fault": fault}[args.mode]()
