"""The planner's measurements: a short probe of the links and the local work, when a strategy starts.

`measure` times, on this worker, the local per-element cost of packing
(float32 copy and the FP16 path) and, through the wrapped TF collectives, a
chain of small and of 1 MB all-reduces; it then all-reduces the figures so
every worker returns the same `gf_tf.planner.Costs` (their mean). Each timing
is the best of a few runs of a traced `tf.function`, so Python and eager
dispatch are not counted. About 1 s at 2 workers; every worker issues the same
collectives in the same order (the same code, no data-dependent branch).
"""

import logging
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from gf_tf import ops, tf_internal
from gf_tf.planner import Costs

_log = logging.getLogger("gf_tf.planner")

LOCAL_ELEMENTS = 1 << 20          # float32 elements of the local packing probe (4 MB)
SMALL_ELEMENTS = 8                # a latency-bound all-reduce
LARGE_ELEMENTS = 1 << 18          # float32 elements of the bandwidth probe (1 MB)
SMALL_CHAIN, LARGE_CHAIN = 8, 3   # all-reduces per timed call
_SUM = tf.distribute.ReduceOp.SUM


def _best_seconds(fn: Callable[[], tf.Tensor], runs: int = 3) -> float:
    """Best wall time of `fn()` (a traced function) over `runs`, after one warm-up call."""
    fn().numpy()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn().numpy()
        best = min(best, time.perf_counter() - start)
    return best


def local_costs(device: str):
    """(copy_s, fp16_s): seconds per float32 element of a float32 pack + unpack, and of
    max |g| + scaled FP16 pack + unpack, on `device`."""
    shapes = [tf.TensorShape([LOCAL_ELEMENTS // 4])] * 4
    with tf.device(device):
        grads = [tf.random.normal(s, seed=i) for i, s in enumerate(shapes)]

    @tf.function
    def copy():
        with tf.device(device):
            out = ops.unpack(ops.pack(grads, tf.float32, 1.0), shapes, [tf.float32] * 4, 1.0)
            return tf.add_n([o[0] for o in out])

    @tf.function
    def fp16():
        with tf.device(device):
            scale = 1.0 / (tf.reduce_max(ops.abs_max(grads)) + 1.0)
            out = ops.unpack(ops.pack(grads, tf.float16, scale), shapes, [tf.float32] * 4,
                             1.0 / scale)
            return tf.add_n([o[0] for o in out])

    return _best_seconds(copy) / LOCAL_ELEMENTS, _best_seconds(fp16) / LOCAL_ELEMENTS


def _chain_seconds(cross_ops, devices: Sequence[str], options, elements: int, count: int,
                   workers: int) -> float:
    """Seconds per all-reduce of `elements` float32 over `count` dependent all-reduces."""
    inputs = []
    for device in devices:
        with tf.device(device):
            inputs.append(tf.ones([elements], tf.float32))

    @tf.function
    def chain():
        values = inputs
        for _ in range(count):
            pr = tf_internal.per_replica(values)
            reduced = cross_ops.batch_reduce_implementation(_SUM, [(pr, pr)], options)[0]
            values = [v * (1.0 / workers) for v in tf_internal.local_values(reduced)]
        return values[0][0]

    return _best_seconds(chain, runs=2) / count


def measure(cross_ops: tf.distribute.CrossDeviceOps, devices: Sequence[str], options,
            workers: int) -> Costs:
    """The cost model's constants, averaged over the workers (the same on every worker).

    Args:
      cross_ops: the TF cross-device ops that carry the collectives (the strategy's own).
      devices: this worker's replica devices.
      options: tf.distribute.experimental.CommunicationOptions (its timeout applies).
      workers: N, the number of workers (> 1).

    Raises: what the collectives raise (a peer lost: TF's error at the timeout).
    """
    start = time.perf_counter()
    copy_s, fp16_s = local_costs(devices[0])
    small = _chain_seconds(cross_ops, devices, options, SMALL_ELEMENTS, SMALL_CHAIN, workers)
    large = _chain_seconds(cross_ops, devices, options, LARGE_ELEMENTS, LARGE_CHAIN, workers)
    hops = 2 * (workers - 1)
    mine = [small / hops, max(0.0, large - small) / (hops / workers * 4 * LARGE_ELEMENTS),
            copy_s, fp16_s]
    table = []
    for i, device in enumerate(devices):
        with tf.device(device):
            table.append(tf.constant(mine if i == 0 else [0.0] * 4, tf.float64))
    pr = tf_internal.per_replica(table)
    summed = cross_ops.batch_reduce_implementation(_SUM, [(pr, pr)], options)[0]
    mean = np.asarray(tf_internal.local_values(summed)[0]) / workers
    costs = Costs(*[float(x) for x in mean])
    _log.info("gf_tf: measured %.3f ms per hop, %.2f ns per wire byte (%.2f Gbit/s), local "
              "%.2f / %.2f ns per element (float32 / FP16 packing), in %.1f s",
              1e3 * costs.hop_s, 1e9 * costs.byte_s, 8e-9 / max(costs.byte_s, 1e-15),
              1e9 * costs.copy_s, 1e9 * costs.fp16_s, time.perf_counter() - start)
    return costs
