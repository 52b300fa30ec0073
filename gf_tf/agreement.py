"""The cross-worker settings handshake of GradientFlowAllReduce.

Every worker must issue the same collectives in the same order with the same
dtypes and shapes, or the job hangs or fails with TensorFlow's
"Collective instance ... expected type ... but got ..." at the timeout. Before
the first compressed step of each trace, the workers compare their settings
in one fixed-shape collective that cannot itself mismatch, and a difference
raises a ValueError naming the setting and each worker's value.
"""

from typing import Callable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from gf_tf import collectives

# (name, number, how to print the number) of one setting.
Setting = Tuple[str, float, Callable[[float], str]]


def hex_text(code) -> str:
    """How a CRC32 setting is printed: 8 hex digits."""
    return f"{int(code):08x}"


def check_workers_agree(workers, settings: List[Setting], devices: Sequence[str],
                        cross_device_ops: tf.distribute.CrossDeviceOps, options) -> None:
    """Fixed-shape handshake: a float64 [workers x (1 + settings)] SUM all-reduce.

    Each worker's local replica 0 writes [1, settings...] into its row, every
    other replica zeros; the sum is the table of all workers' settings. It
    runs eagerly (tf.init_scope) while the step is traced, so a mismatch
    raises before any packed collective exists.

    Args:
      workers: gf_tf.strategy.WorkerInfo (rank, names).
      settings: what must agree, as (name, number, how to print it).
      devices: this worker's replica devices (one row each).
      cross_device_ops: TF ops that carry the table (the wrapped ops).
      options: CommunicationOptions (the timeout bounds a missing worker).

    Raises:
      ValueError: "gf_tf.GradientFlowAllReduce settings differ across workers ...",
        listing each differing setting with every worker's value.
    """
    if workers.num_workers == 1:
        return
    width = 1 + len(settings)
    mine = np.zeros([workers.num_workers, width], np.float64)
    mine[workers.rank] = [1.0] + [float(number) for _, number, _ in settings]
    ring = collectives.ring.ring_sum(cross_device_ops, options)
    table = collectives.sum_over_workers(ring, devices, mine).reshape(mine.shape)
    problems = []
    for k, (name, _, show) in enumerate(settings, start=1):
        column = table[:, k]
        if np.any(column != column[0]) or np.any(table[:, 0] != 1.0):
            listed = ", ".join(f"{worker} = {show(v)}" for worker, v in zip(workers.names, column))
            problems.append(f"{name}: {listed}")
    if problems:
        raise ValueError(
            "gf_tf.GradientFlowAllReduce settings differ across workers (every worker must "
            "use the same compression, bytes_per_pack, sparsity and model): "
            + "; ".join(problems))
