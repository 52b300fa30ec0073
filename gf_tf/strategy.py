"""gf_tf.MultiWorkerMirroredStrategy: TensorFlow's multi-worker strategy with GradientFlow.

The private TensorFlow wiring it needs is in `gf_tf.tf_internal`.
"""

import dataclasses
from typing import Tuple

import tensorflow as tf

from gf_tf import cross_device_ops, keras_compat, tf_internal


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Where this process sits among the workers of a collective group."""
    rank: int                  # 0 .. num_workers - 1, chief first
    names: Tuple[str, ...]     # e.g. ("worker 0", "worker 1"), by rank

    @property
    def num_workers(self) -> int:
        return len(self.names)


# --- the multi-worker strategy ----------------------------------------------

_DEFAULT = object()


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` with GradientFlow all-reduce.

    Args:
      cluster_resolver, communication_options: as for
        `tf.distribute.MultiWorkerMirroredStrategy` (TF_CONFIG by default). Set
        `CommunicationOptions(timeout_seconds=...)` so a lost worker fails fast.
      gradient_flow: the `gf_tf.GradientFlowAllReduce` carrying the gradients
        (default: `GradientFlowAllReduce()`, packed FP16), or None for plain
        TensorFlow all-reduce. The strategy's own CollectiveAllReduce is wrapped,
        so instance keys, RING/NCCL and timeouts stay TensorFlow's. Create it
        outside any strategy scope; one instance serves one strategy.

    Also installs the Keras 3 multi-worker `model.fit` fixes of
    `gf_tf.keras_compat` (keras-team/keras#20585), with or without GradientFlow.

    Raises:
      RuntimeError: untested TensorFlow or Keras version.
      TypeError: gradient_flow is not a GradientFlowAllReduce.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 gradient_flow=_DEFAULT):
        tf_internal.check_tf_version()
        if gradient_flow is not _DEFAULT and gradient_flow is not None and not isinstance(
                gradient_flow, cross_device_ops.GradientFlowAllReduce):
            raise TypeError(f"gradient_flow must be a gf_tf.GradientFlowAllReduce or None, "
                            f"got {type(gradient_flow).__name__}")
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        keras_compat.install()
        if gradient_flow is _DEFAULT:
            # Created after the strategy: its variables then live on this worker's job.
            gradient_flow = cross_device_ops.GradientFlowAllReduce()
        self.gradient_flow = gradient_flow
        if gradient_flow is not None:
            gradient_flow._attach(tf_internal.cross_device_ops_of(self), _worker_info(self))  # pylint: disable=protected-access
            tf_internal.set_cross_device_ops(self, gradient_flow)


def _worker_info(strategy) -> WorkerInfo:
    """Rank and names of the workers, chief first, from the public cluster resolver."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict() if resolver else {}
    tasks = [(job, i) for job in ("chief", "worker") for i in range(len(spec.get(job, [])))]
    if not tasks or resolver.task_type not in ("chief", "worker"):
        return WorkerInfo(rank=0, names=("worker 0",))
    names = tuple(f"{job} {i}" for job, i in tasks)
    return WorkerInfo(rank=tasks.index((resolver.task_type, int(resolver.task_id))), names=names)
