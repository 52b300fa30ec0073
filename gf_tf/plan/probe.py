"""The planner's measurements: a short probe of the links and the local work, when a strategy starts.

`measure` times, on this worker, the local per-element cost of every registered
wire format's pack + unpack (`gf_tf.wire.FORMATS`), a chain of small all-reduces
by every registered algorithm (`gf_tf.collectives.ALGORITHMS`: its latency
unit) and a chain of 1 MB all-reduces by TensorFlow's own (the link's seconds
per byte); it then all-reduces the figures so every worker returns the same
`gf_tf.plan.records.Costs` (their mean). Each timing is the best of a few runs
of a traced `tf.function`, so Python and eager dispatch are not counted. It
takes a few seconds; every worker issues the same collectives in the same order
(the same code, no data-dependent branch).
"""

import logging
import time
from typing import Callable, Sequence

import tensorflow as tf

from gf_tf import collectives, ops, wire
from gf_tf.plan.records import Costs

_log = logging.getLogger(__name__)

LOCAL_ELEMENTS = 1 << 20          # float32 elements of the local packing probe (4 MB)
SMALL_ELEMENTS = 8                # a latency-bound all-reduce
LARGE_ELEMENTS = 1 << 18          # float32 elements of the bandwidth probe (1 MB)
SMALL_CHAIN, LARGE_CHAIN = 8, 3   # all-reduces per timed call


def _best_seconds(fn: Callable[[], tf.Tensor], runs: int = 3) -> float:
    """Best wall time of `fn()` (a traced function) over `runs`, after one warm-up call."""
    fn().numpy()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn().numpy()
        best = min(best, time.perf_counter() - start)
    return best


def local_seconds(wire_format: wire.WireFormat, device: str) -> float:
    """Seconds per float32 element of `wire_format`'s pack + unpack on `device` (a scaled
    wire: with max |g| and its scale)."""
    shapes = [tf.TensorShape([LOCAL_ELEMENTS // 4])] * 4
    dtype = wire_format.dtype or tf.float32
    with tf.device(device):
        grads = [tf.random.normal(s, seed=i) for i, s in enumerate(shapes)]

    @tf.function(autograph=False)   # AutoGraph would convert every gf_tf helper it calls
    def round_trip():
        with tf.device(device):
            scale = 1.0 / (tf.reduce_max(ops.abs_max(grads)) + 1.0) if wire_format.scaled else 1.0
            out = ops.unpack(ops.pack(grads, dtype, scale), shapes, [tf.float32] * 4, 1.0 / scale)
            return tf.add_n([o[0] for o in out])

    return _best_seconds(round_trip) / LOCAL_ELEMENTS


def _chain_seconds(all_reduce_sum, devices: Sequence[str], elements: int, count: int,
                   workers: int) -> float:
    """Seconds per all-reduce of `elements` float32 over `count` dependent all-reduces."""
    inputs = []
    for device in devices:
        with tf.device(device):
            inputs.append(tf.ones([elements], tf.float32))

    @tf.function(autograph=False)   # AutoGraph would convert every gf_tf helper it calls
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

    Raises:
      tf.errors.OpError: what the collectives raise (a peer lost: TF's error at the
        timeout).
    """
    start = time.perf_counter()
    n = workers.num_workers
    formats = list(wire.FORMATS.values())
    local = [local_seconds(f, devices[0]) for f in formats]
    ring = collectives.ring.tf_sum(cross_ops, options)
    context = collectives.Context(ring, cross_ops, workers, tuple(devices), True, options)
    latency = {}
    for name, algorithm in collectives.ALGORITHMS.items():
        chain = _chain_seconds(algorithm.build(context), devices, SMALL_ELEMENTS, SMALL_CHAIN, n)
        latency[name] = chain / algorithm.latency_units(n)
    tf_own = collectives.tf_own()
    small = latency[tf_own.name] * tf_own.latency_units(n)
    large = _chain_seconds(ring, devices, LARGE_ELEMENTS, LARGE_CHAIN, n)
    byte_s = max(0.0, large - small) / (tf_own.byte_factor(n) * 4 * LARGE_ELEMENTS)
    mine = [byte_s] + list(latency.values()) + local
    mean = [float(x) for x in collectives.sum_over_workers(ring, devices, mine) / n]
    costs = Costs(mean[0], dict(zip(latency, mean[1:1 + len(latency)])),
                  {f.method: x for f, x in zip(formats, mean[1 + len(latency):])})
    _log.info("gf_tf: measured latency %s ms, %.2f ns per wire byte (%.2f Gbit/s), local %s ns "
              "per element, in %.1f s",
              {k: round(1e3 * v, 3) for k, v in costs.latency_s.items()}, 1e9 * costs.byte_s,
              8e-9 / max(costs.byte_s, 1e-15),
              {k: round(1e9 * v, 2) for k, v in costs.local_s.items()}, time.perf_counter() - start)
    return costs
