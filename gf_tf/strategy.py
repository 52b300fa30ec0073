"""gf_tf.MultiWorkerMirroredStrategy: TensorFlow's multi-worker strategy with GradientFlow.

The private TensorFlow wiring it needs is in `gf_tf.tf_internal`.
"""

import dataclasses
from typing import Tuple

import tensorflow as tf

from gf_tf import cross_device_ops, keras_compat, tf_internal, watchdog


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
# Seconds a worker waits at start-up for peers that have not started (then fails naming them).
DEFAULT_PEER_STARTUP_TIMEOUT = 300.0


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

      peer_startup_timeout: seconds every worker waits at start-up for peers
        that have not started; then it fails with a message naming them
        (default 300; None waits forever, TensorFlow's default). On the
        leader (chief, or worker 0), where TensorFlow's wait cannot be
        interrupted, a watchdog process prints that message and kills it (SIGKILL). A peer lost
        later is detected by TensorFlow's coordination-service heartbeats (a
        killed worker within a second here, a frozen one in about 7 s).

    Also installs the Keras 3 multi-worker `model.fit` fixes of
    `gf_tf.keras_compat` (keras-team/keras#20585), with or without GradientFlow.

    Raises:
      RuntimeError: untested TensorFlow or Keras version.
      TypeError: gradient_flow is not a GradientFlowAllReduce.
      ValueError: peer_startup_timeout is not a positive number or None.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 gradient_flow=_DEFAULT, peer_startup_timeout=DEFAULT_PEER_STARTUP_TIMEOUT):
        tf_internal.check_tf_version()
        if gradient_flow is not _DEFAULT and gradient_flow is not None and not isinstance(
                gradient_flow, cross_device_ops.GradientFlowAllReduce):
            raise TypeError(f"gradient_flow must be a gf_tf.GradientFlowAllReduce or None, "
                            f"got {type(gradient_flow).__name__}")
        guard = None
        if peer_startup_timeout is not None:
            if not peer_startup_timeout > 0:
                raise ValueError(f"peer_startup_timeout must be > 0 seconds or None, got {peer_startup_timeout}")
            guard = _startup_watchdog(cluster_resolver, peer_startup_timeout)
        try:
            super().__init__(cluster_resolver=cluster_resolver,
                             communication_options=communication_options)
        finally:
            if guard is not None:
                guard.kill()
                guard.wait()
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



def _startup_watchdog(cluster_resolver, seconds: float):
    """A started `gf_tf.watchdog` that ends this process if the cluster has not formed within `seconds`.

    A non-leader worker gets TensorFlow's own error after the coordination
    service's registration timeout (set here too). The leader (chief, or
    worker 0) waits for missing peers inside TensorFlow with no timeout, holding
    the GIL, so a separate process prints one line naming the peers whose port
    does not answer and SIGKILLs it. None for a one-worker cluster.
    """
    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    tasks = [(job, i, address) for job in ("chief", "worker") if job in spec.jobs
             for i, address in enumerate(spec.job_tasks(job))]
    if len(tasks) < 2:
        return None
    tf_internal.configure_peer_startup_timeout(spec, seconds)
    me = (resolver.task_type, int(resolver.task_id or 0))
    peers = [(f"{job} {i}", address) for job, i, address in tasks if (job, i) != me]
    return watchdog.start("deadline", f"gf_tf: error: {me[0]} {me[1]}", seconds, peers)
