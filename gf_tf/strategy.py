"""gf_tf.MultiWorkerMirroredStrategy: TensorFlow's multi-worker strategy with GradientFlow.

The private TensorFlow wiring it needs is in `gf_tf.tf_internal`.
"""

import tensorflow as tf

from gf_tf import agreement, cluster as cluster_lib
from gf_tf import cross_device_ops, integrations, tf_internal, watchdog
from gf_tf.cluster import WorkerInfo  # noqa: F401 (re-exported as gf_tf.strategy.WorkerInfo)

_DEFAULT = object()
# Seconds a worker waits at start-up for peers that have not started (then fails naming them):
# a cluster's workers (pods, hosts started by hand) can start minutes apart. TF waits forever.
DEFAULT_PEER_STARTUP_TIMEOUT = 300.0
"""`MultiWorkerMirroredStrategy(peer_startup_timeout=)`: seconds a worker waits for peers."""


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` with GradientFlow all-reduce.

    Args:
      cluster_resolver (tf.distribute.cluster_resolver.ClusterResolver | None): as
        for `tf.distribute.MultiWorkerMirroredStrategy` (default: TF_CONFIG).
      communication_options (tf.distribute.experimental.CommunicationOptions | None):
        as for `tf.distribute.MultiWorkerMirroredStrategy`. `timeout_seconds` ends a step
        that waits that long for a stuck peer (`DeadlineExceededError`). TensorFlow starts
        one thread per collective that carries a timeout, which sleeps the whole timeout
        (tensorflow#62466): (collectives a second) x timeout threads, tens of thousands on a
        fast step. So gf_tf's collectives of a gradient step, and the scalar logs of
        `model.fit`, carry none: one watchdog thread per process keeps the step's deadline
        (`gf_tf.collectives.deadline`). Every other collective (metrics read at an epoch's
        end, SyncBatchNorm, your own, TF's gradient all-reduce with `gradient_flow=None`)
        keeps the timeout and its thread.
      gradient_flow (GradientFlowAllReduce | None): the `gf_tf.GradientFlowAllReduce`
        carrying the gradients (default: `GradientFlowAllReduce()`, the planner), or
        None for plain TensorFlow all-reduce. The strategy's own CollectiveAllReduce
        is wrapped, so instance keys and RING/NCCL stay TensorFlow's.
        Create it outside any strategy scope; one instance serves one strategy.
      peer_startup_timeout (float | None): seconds every worker waits at start-up
        for peers that have not started; then it fails with a message naming them
        (default DEFAULT_PEER_STARTUP_TIMEOUT, 300; None waits forever,
        TensorFlow's default). While it waits, it says which peers it waits for
        and until when, after 10 s and then every 30 s (`gf_tf.watchdog`). On the
        leader (chief, or worker 0), where TensorFlow's wait cannot be
        interrupted, a watchdog process prints that message and kills it
        (SIGKILL). A peer lost later is detected by TensorFlow's
        coordination-service heartbeats.
      heartbeat_timeout (float | None): seconds without a peer's
        coordination-service heartbeats before every worker gives it up
        (default None: TensorFlow's, 10 s). Raise it on slow links: heartbeats
        share the link with the collectives, and a large transfer (a big
        model's initial broadcast over a slow link) can hold them back past
        the timeout (`DeadlineExceededError ... CoordinationService/Heartbeat`
        from a live peer). A frozen peer is then noticed that much later.

    Also installs the Keras 3 multi-worker `model.fit` fixes of the Keras wing
    (`gf_tf.keras.patches`, keras-team/keras#20585), with or without GradientFlow.

    Raises:
      RuntimeError: untested TensorFlow or Keras version, or created after TensorFlow ran an
        op in this process.
      PeerMismatchError: `gf_tf.agreement.PeerMismatchError`, a RuntimeError: the
        planner's cost probe (with peers and a setting "auto") failed, as when a peer
        is not running GradientFlow.
      TypeError: gradient_flow is not a GradientFlowAllReduce.
      ValueError: peer_startup_timeout or heartbeat_timeout is not a positive number or None, or
        TF_CONFIG is malformed (the message names the field; `gf_tf.cluster`).
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 gradient_flow=_DEFAULT, peer_startup_timeout=DEFAULT_PEER_STARTUP_TIMEOUT,
                 heartbeat_timeout=None):
        tf_internal.check_tf_version()
        if gradient_flow is not _DEFAULT and gradient_flow is not None and not isinstance(
                gradient_flow, cross_device_ops.GradientFlowAllReduce):
            raise TypeError(f"gradient_flow must be a gf_tf.GradientFlowAllReduce or None, "
                            f"got {type(gradient_flow).__name__}")
        for name, value in (("peer_startup_timeout", peer_startup_timeout),
                            ("heartbeat_timeout", heartbeat_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds or None, got {value}")
        guard = _startup_watchdog(cluster_resolver, peer_startup_timeout, heartbeat_timeout)
        try:
            super().__init__(cluster_resolver=cluster_resolver,
                             communication_options=communication_options)
        except RuntimeError as e:
            if "must be configured at program startup" not in str(e):
                raise
            raise RuntimeError(
                "gf_tf.MultiWorkerMirroredStrategy must be created before this process runs "
                "any TensorFlow op (TensorFlow configures its collectives once, when it starts: "
                f"\"{e}\"). Create the strategy first, before any tensor, dataset or model, "
                "as in TensorFlow's multi-worker guide.") from e
        finally:
            if guard is not None:
                guard.kill()
                guard.wait()
        integrations.install_all()   # the Keras fixes, with or without GradientFlow
        if gradient_flow is _DEFAULT:
            # Created after the strategy: its variables then live on this worker's job.
            gradient_flow = cross_device_ops.GradientFlowAllReduce()
        self.gradient_flow = gradient_flow
        if gradient_flow is not None:
            try:
                gradient_flow._attach(  # pylint: disable=protected-access
                    tf_internal.cross_device_ops_of(self),
                    cluster_lib.from_resolver(self.cluster_resolver).worker_info(),
                    self.extended.worker_devices,
                    communication_options or tf.distribute.experimental.CommunicationOptions())
            except tf.errors.OpError as e:
                raise agreement.peer_mismatch_error(
                    e, "the planner's cost probe (at strategy creation)") from e
            tf_internal.set_cross_device_ops(self, gradient_flow)


def _startup_watchdog(cluster_resolver, seconds, heartbeat_seconds=None):
    """A started `gf_tf.watchdog` that ends this process if the cluster has not formed within `seconds`.

    A non-leader worker gets TensorFlow's own error after the coordination
    service's registration timeout (set here too). The leader (chief, or
    worker 0) waits for missing peers inside TensorFlow with no timeout, holding
    the GIL, so a separate process prints one line naming the peers whose port
    does not answer and SIGKILLs it. Until then it says every so often which
    peers this worker waits for. `seconds` None: no deadline, only those lines.
    `heartbeat_seconds` configures the service's heartbeat timeout alongside.
    None for a one-worker cluster.
    """
    cluster = (cluster_lib.from_tf_config() if cluster_resolver is None
               else cluster_lib.from_resolver(cluster_resolver))
    if not cluster.is_multi_worker:
        return None
    if seconds is not None or heartbeat_seconds is not None:
        tf_internal.configure_coordination_service(cluster, seconds, heartbeat_seconds)
    return watchdog.start("deadline", f"{cluster.task_type} {cluster.task_index}", seconds, cluster.peers)
