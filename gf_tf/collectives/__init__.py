"""How packs cross workers: a registry of collective algorithms, each with its cost formula.

An `Algorithm` builds a SUM all-reduce (the contract of
`gf_tf.reducers.Communicator.all_reduce_sum`) for one call's `Context`, and
states its alpha-beta cost (Thakur, Rabenseifner & Gropp 2005, "Optimization
of collective communication operations in MPICH"): one all-reduce of B bytes
per worker over N workers takes

    latency_units(N) * alpha  +  byte_factor(N) * B * beta

where alpha is the algorithm's own latency unit (a ring hop; a round of
recursive doubling), measured for each algorithm by `gf_tf.plan.probe`, and
beta the link's seconds per byte. Adding an algorithm is one module and one
`register` call; the planner, the probe and the orchestrator read the registry.
The first registered algorithm is the wrapped TensorFlow ops' own collective:
TensorFlow's own float32 all-reduce travels by it.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from gf_tf.collectives import recursive_doubling, ring

SumFn = Callable[[List[tf.Tensor]], List[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class Context:
    """What an algorithm may build its all-reduce from, for one call.

    Attributes:
      tf_sum: TensorFlow's own SUM all-reduce through the wrapped ops
        (`ring.tf_sum`, merge-call or replica-context form): one 1-D tensor per
        served replica in, per served replica the SUM over all replicas of all workers out.
      cross_ops: the wrapped TF cross-device ops.
      workers: `gf_tf.cluster.WorkerInfo`, or None (one worker).
      devices: the served replicas' devices.
      all_replicas: every local replica is served (the merge-call path).
      options: `tf.distribute.experimental.CommunicationOptions`, or None.
    """
    tf_sum: SumFn
    cross_ops: Optional[tf.distribute.CrossDeviceOps]
    workers: object
    devices: Tuple[str, ...]
    all_replicas: bool
    options: object = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One collective algorithm, with its alpha-beta cost.

    One all-reduce of B bytes per worker over N workers is predicted to take
    `latency_units(N) * alpha + byte_factor(N) * B * beta` seconds (Thakur,
    Rabenseifner & Gropp 2005), alpha this algorithm's latency unit and beta the
    link's seconds per byte, both measured by `gf_tf.plan.probe`.

    Attributes:
      name: what users pass as `GradientFlowAllReduce(algorithm=)`.
      build: `Context` -> the SUM all-reduce (the contract of
        `gf_tf.reducers.Communicator.all_reduce_sum`).
      latency_units: N -> latency units of one all-reduce over N workers (0 for N = 1).
      byte_factor: N -> how many times each worker's bytes cross its link.
      same_as_tf_own: N -> True where an exact (float32) wire over it is TensorFlow's
        own all-reduce again, so compression="auto" does not consider float32 packs
        over it.
    """
    name: str
    build: Callable[[Context], SumFn]
    latency_units: Callable[[int], float]
    byte_factor: Callable[[int], float]
    same_as_tf_own: Callable[[int], bool]

    def seconds(self, nbytes: float, workers: int, latency_s: float, byte_s: float) -> float:
        """Predicted seconds of one SUM all-reduce of `nbytes` per worker."""
        if workers <= 1:
            return 0.0
        return self.latency_units(workers) * latency_s + self.byte_factor(workers) * nbytes * byte_s


ALGORITHMS: Dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Adds (or replaces) an algorithm under its name; returns it. Every worker must register
    the same algorithms in the same order (the probe measures them in that order)."""
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


RING = register(Algorithm("ring", ring.build, ring.hops, lambda n: ring.hops(n) / n,
                          lambda n: True)).name
RECURSIVE_DOUBLING = register(Algorithm(
    "recursive_doubling", recursive_doubling.build, recursive_doubling.rounds,
    recursive_doubling.rounds, lambda n: n <= 2)).name   # at N = 2 one round is a 2-member ring


def get(name: str) -> Algorithm:
    """The registered algorithm `name`.

    Raises:
      ValueError: no algorithm of that name (the message lists the registered ones).
    """
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be \"auto\" or one of {list(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]


def tf_own() -> Algorithm:
    """The algorithm of TensorFlow's own all-reduce: the first registered (the ring)."""
    return next(iter(ALGORITHMS.values()))


def sum_over_workers(all_reduce_sum: SumFn, devices: Sequence[str], values) -> np.ndarray:
    """float64 [len(values)]: the SUM over the workers of each worker's `values`, the same
    bits on every worker. One all-reduce, run eagerly: the first local replica carries
    `values`, the others zeros."""
    values = np.asarray(values, np.float64).ravel()
    with tf.init_scope():
        rows = []
        for i, device in enumerate(devices):
            with tf.device(device):
                rows.append(tf.constant(values if i == 0 else np.zeros(values.size), tf.float64))
        return np.asarray(all_reduce_sum(rows)[0])
