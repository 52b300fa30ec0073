"""The planner's measurements: a short probe of the links and the local work, when a strategy starts.

`measure` times, on this worker, the local per-element cost of packing
(float32 copy and the FP16 path), a chain of small and of 1 MB ring
all-reduces (the wrapped TF collectives) and a chain of small recursive-doubling
all-reduces (`gf_tf.collectives`); it then all-reduces the figures so
every worker returns the same `gf_tf.planner.Costs` (their mean). Each timing
is the best of a few runs of a traced `tf.function`, so Python and eager
dispatch are not counted. 1-4 s here at 2 workers; every worker issues the same
collectives in the same order (the same code, no data-dependent branch).
"""

import logging
import time
from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

from gf_tf import collectives, ops, planner, tf_internal
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


def ring_sum(cross_ops, options) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """The wrapped TF ops' SUM all-reduce, per local replica a tensor (Communicator's contract)."""
    def all_reduce(tensors):
        pr = tf_internal.per_replica(tensors)
        return tf_internal.local_values(
            cross_ops.batch_reduce_implementation(_SUM, [(pr, pr)], options)[0])
    return all_reduce


def mean_over_workers(all_reduce_sum, devices: Sequence[str], values, num_workers: int) -> np.ndarray:
    """float64 [len(values)]: the mean over the workers of each worker's `values`, the same bits
    on every worker (one SUM all-reduce: the first local replica carries them, the others zeros)."""
    rows = []
    for i, device in enumerate(devices):
        with tf.device(device):
            rows.append(tf.constant(values if i == 0 else np.zeros(len(values)), tf.float64))
    return np.asarray(all_reduce_sum(rows)[0]) / num_workers


def _chain_seconds(all_reduce_sum, devices: Sequence[str], elements: int, count: int,
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
            values = [v * (1.0 / workers) for v in all_reduce_sum(values)]
        return values[0][0]

    return _best_seconds(chain, runs=2) / count


def measure(cross_ops: tf.distribute.CrossDeviceOps, devices: Sequence[str], options,
            workers) -> Costs:
    """The cost model's constants, averaged over the workers (the same on every worker).

    Args:
      cross_ops: the TF cross-device ops that carry the collectives (the strategy's own).
      devices: this worker's replica devices.
      options: tf.distribute.experimental.CommunicationOptions (its timeout applies).
      workers: gf_tf.cluster.WorkerInfo of this worker (N > 1).

    Raises: what the collectives raise (a peer lost: TF's error at the timeout).
    """
    start = time.perf_counter()
    n = workers.num_workers
    copy_s, fp16_s = local_costs(devices[0])
    ring = ring_sum(cross_ops, options)
    doubling = collectives.recursive_doubling_sum(cross_ops, workers, devices, options)
    small = _chain_seconds(ring, devices, SMALL_ELEMENTS, SMALL_CHAIN, n)
    large = _chain_seconds(ring, devices, LARGE_ELEMENTS, LARGE_CHAIN, n)
    rounds = _chain_seconds(doubling, devices, SMALL_ELEMENTS, SMALL_CHAIN, n)
    hops = 2 * (n - 1)
    mine = [small / hops, rounds / planner.recursive_doubling_rounds(n),
            max(0.0, large - small) / (hops / n * 4 * LARGE_ELEMENTS), copy_s, fp16_s]
    costs = Costs(*[float(x) for x in mean_over_workers(ring, devices, mine, n)])
    _log.info("gf_tf: measured %.3f ms per ring hop, %.3f ms per recursive-doubling round, "
              "%.2f ns per wire byte (%.2f Gbit/s), local %.2f / %.2f ns per element "
              "(float32 / FP16 packing), in %.1f s",
              1e3 * costs.hop_s, 1e3 * costs.round_s, 1e9 * costs.byte_s,
              8e-9 / max(costs.byte_s, 1e-15),
              1e9 * costs.copy_s, 1e9 * costs.fp16_s, time.perf_counter() - start)
    return costs
