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
from gf_tf.worker import COLLECTIVE_MISMATCH

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
      workers: gf_tf.cluster.WorkerInfo (rank, names).
      settings: what must agree, as (name, number, how to print it).
      devices: this worker's replica devices (one row each).
      cross_device_ops: TF ops that carry the table (the wrapped ops).
      options: CommunicationOptions (the timeout bounds a missing worker).

    Raises:
      ValueError: "gf_tf.GradientFlowAllReduce settings differ across workers ...",
        listing each differing setting with every worker's value.
      PeerMismatchError: the table's all-reduce failed (`peer_mismatch_error`).
    """
    if workers.num_workers == 1:
        return
    width = 1 + len(settings)
    mine = np.zeros([workers.num_workers, width], np.float64)
    mine[workers.rank] = [1.0] + [float(number) for _, number, _ in settings]
    ring = collectives.ring.tf_sum(cross_device_ops, options)
    try:
        table = collectives.sum_over_workers(ring, devices, mine).reshape(mine.shape)
    except tf.errors.OpError as e:
        raise peer_mismatch_error(e, "the settings handshake (at the first trace of a step)") from e
    problems = []
    for k, (name, _, show) in enumerate(settings, start=1):
        column = table[:, k]
        if np.any(column != column[0]) or np.any(table[:, 0] != 1.0):
            listed = ", ".join(f"{worker} = {show(v)}" for worker, v in zip(workers.names, column))
            problems.append(f"{name}: {listed}")
    if problems:
        raise ValueError(
            "gf_tf.GradientFlowAllReduce settings differ across workers (every worker must "
            "use the same compression, bytes_per_pack, sparsity, reducer and model): "
            + "; ".join(problems))


class PeerMismatchError(RuntimeError):
    """gf_tf's first collective with its peers failed (`peer_mismatch_error` words it)."""


def peer_mismatch_error(error: tf.errors.OpError, collective: str) -> PeerMismatchError:
    """The error to raise when gf_tf's own first collective with its peers, `collective`, fails.

    TensorFlow reports workers that issue different collectives as "Collective
    instance N expected type ... but got ..." on one worker (not the leader) and,
    once that worker has died, as a lost peer on the others. Either way the usual
    cause is a worker that is not running GradientFlow with the same settings,
    which TensorFlow's words do not name. A peer that really stopped reads the
    same way, so the message names both, with TensorFlow's own line.
    """
    line = next((l.strip() for l in str(error).splitlines()
                 if COLLECTIVE_MISMATCH.search(l) or "aborted" in l.lower() or "deadline" in l.lower()),
                str(error).strip().splitlines()[0] if str(error).strip() else "")
    if COLLECTIVE_MISMATCH.search(str(error)):
        cause = "the workers issued different collectives"
    else:
        cause = "a peer worker stopped, or it issued a different collective"
    return PeerMismatchError(
        f"gf_tf: {collective} failed: {cause} ({type(error).__name__}: {line[:300]}). Every "
        f"worker must run gf_tf.MultiWorkerMirroredStrategy (or GradientFlowAllReduce) with the "
        f"same settings: a worker on plain tf.distribute, with gradient_flow=None, or on another "
        f"gf_tf version cannot join workers that use GradientFlow. If every worker does, look "
        f"for a peer that stopped (its log), then restart every worker.")
