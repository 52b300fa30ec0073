"""Every private TensorFlow name gf_tf uses, in one place, behind `check_tf_version`.

TensorFlow offers no public way to choose the cross-device ops of
`tf.distribute.MultiWorkerMirroredStrategy`, to build the `PerReplica` /
`Mirrored` values a `tf.distribute.CrossDeviceOps` exchanges, to create a plain
variable inside a strategy scope, or to tell an XLA graph apart. The private
pieces used for that:

- `tensorflow.python.distribute.values.PerReplica`, `distribute_utils.regroup`
  (to build and return distributed values),
- `extended._use_merge_call()` (False: replica-context all-reduce, XLA on all GPUs),
- `MirroredStrategy.extended._cross_device_ops` (the GradientFlowAllReduce a user gave),
- `CrossDeviceOps._num_between_graph_workers` (workers in the collective group),
  `CrossDeviceOps._all_reduce` and `._gather_implementation` of the wrapped ops
  (GradientFlowAllReduce overrides the same methods, as TF's contract asks),
- `MirroredStrategy.extended._collective_ops` (the ops TF uses by default),
- `MultiWorkerMirroredStrategy.extended._cross_device_ops` (replaced after
  construction, before anything is traced) and `._communication_options` (the timeout
  its collectives merge in),
- `resource_variable_ops.ResourceVariable` (CSC state outside the strategy's
  variable creator),
- `control_flow_util.GraphOrParentsInXlaContext` (XLA graphs use the composite ops),
- `saved_model.save_context.in_save_context` (`tf.saved_model.save` traces every
  object's checkpoint functions into the SavedModel; ours must not capture the
  CSC state's variables there, which the SavedModel does not track),
- `CollectiveAllReduce._launchers[0]` (a `CollectiveReplicaLauncher`): its
  `_next_instance_key()`, `_get_ordering_token()` and the ops' `_options`
  (`gf_tf.collectives` draws its instance keys from TF's own allocator and
  orders its subgroup collectives with TF's),
- `ops.collective_ops.all_reduce_v2`, `broadcast_send_v2` and `broadcast_recv_v2`
  (2-member collectives of recursive doubling),
- `context.context().configure_coordination_service` and `coordination_config_pb2`
  (how long workers wait for a peer that never starts; the leader is `gf_tf.cluster`'s,
  which mirrors `multi_worker_util.coordination_leader`); `context.context().wait_at_barrier`
  (workers leave together, `gf_tf.worker.exit_together`);
  `context.context().abort_collective_ops` (a step's deadline, `gf_tf.collectives.deadline`,
  ends the collectives that wait for a stuck peer, as TF's own health check does).

This module imports nothing of gf_tf.
"""

from typing import List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops
from tensorflow.python.distribute import distribute_utils as _tf_distribute_utils
from tensorflow.python.distribute import values as _tf_values
from tensorflow.python.ops import collective_ops as _tf_collective_ops
from tensorflow.python.ops import control_flow_util as _tf_control_flow_util
from tensorflow.python.ops import resource_variable_ops as _tf_resource_variable_ops
from tensorflow.python.saved_model import save_context as _tf_save_context

TESTED_TF_VERSIONS = ("2.18", "2.19", "2.20", "2.21")


def check_tf_version(version: str = None) -> None:
    """Raises RuntimeError unless TensorFlow is a version gf_tf's wiring was tested with."""
    version = version or tf.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_TF_VERSIONS:
        raise RuntimeError(
            f"gf_tf touches private tf.distribute internals and was tested with TensorFlow "
            f"{TESTED_TF_VERSIONS[0]}-{TESTED_TF_VERSIONS[-1]} ({', '.join(TESTED_TF_VERSIONS)}) only; "
            f"found TensorFlow {version}. Install a supported one (e.g. "
            f"tensorflow-cpu=={TESTED_TF_VERSIONS[-1]}.*) or port gf_tf/tf_internal.py.")


# --- distributed values ------------------------------------------------------

def per_replica(tensors: Sequence[tf.Tensor]):
    """A PerReplica value of one tensor per local replica."""
    check_tf_version()
    return _tf_values.PerReplica(tuple(tensors))


def mirrored(tensors: Sequence[tf.Tensor]):
    """The all-reduced result of one value: Mirrored (or the tensor itself for one replica), as TF returns it."""
    return _tf_distribute_utils.regroup(tuple(tensors), wrap_class=_tf_values.Mirrored)


def local_values(value) -> List:
    """The per-replica components of a distributed value (a plain value: [value])."""
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def num_workers_of(ops: tf.distribute.CrossDeviceOps) -> int:
    """Workers taking part in `ops`'s collectives (1 for single-worker ops)."""
    return int(ops._num_between_graph_workers)  # pylint: disable=protected-access


def replica_all_reduce(ops: tf.distribute.CrossDeviceOps, reduce_op, value, replica_id: int,
                       options):
    """`ops._all_reduce`: the replica-context all-reduce of one replica's nest of values."""
    return ops._all_reduce(reduce_op, value, replica_id, options)  # pylint: disable=protected-access


def gather(ops: tf.distribute.CrossDeviceOps, per_replica_value, destinations, axis, options):
    """`ops._gather_implementation` (strategy.gather, e.g. Keras's multi-worker predict)."""
    return ops._gather_implementation(per_replica_value, destinations, axis, options)  # pylint: disable=protected-access


def collective_launcher(ops: tf.distribute.CrossDeviceOps):
    """The `CollectiveReplicaLauncher` of `ops`' first local replica (a CollectiveAllReduce's).

    Raises ValueError for cross-device ops that are not TF's CollectiveAllReduce.
    """
    check_tf_version()
    launchers = getattr(ops, "_launchers", None)
    if not isinstance(ops, _tf_cross_device_ops.CollectiveAllReduce) or not launchers:
        raise ValueError(f"recursive doubling runs on TensorFlow's CollectiveAllReduce (the one "
                         f"of MultiWorkerMirroredStrategy), not on {type(ops).__name__}")
    return launchers[0]


def next_instance_key(launcher):
    """A new instance key from TF's allocator: an int32 tensor, fed at call time inside a
    tf.function (TF's own `CollectiveReplicaLauncher._next_instance_key`)."""
    return launcher._next_instance_key()  # pylint: disable=protected-access


def ordering_token(launcher):
    """The resource handle TF orders the launcher's collectives by (None in TF1 graphs)."""
    return launcher._get_ordering_token()  # pylint: disable=protected-access


def pair_all_reduce(value, group_key: int, instance_key, implementation: str, timeout: float,
                    ordering_token):
    """A SUM all-reduce between 2 workers (`collective_ops.all_reduce_v2`, group size 2)."""
    return _tf_collective_ops.all_reduce_v2(value, 2, group_key, instance_key,
                                            communication_hint=implementation, timeout=timeout,
                                            ordering_token=ordering_token)


def pair_broadcast_send(value, group_key: int, instance_key, timeout: float):
    """Sends `value` to the other member of a 2-member group (`collective_ops.broadcast_send_v2`)."""
    return _tf_collective_ops.broadcast_send_v2(value, 2, group_key, instance_key, timeout=timeout)


def pair_broadcast_recv(shape, dtype, group_key: int, instance_key, timeout: float):
    """Receives what the other member of a 2-member group sends (`broadcast_recv_v2`)."""
    return _tf_collective_ops.broadcast_recv_v2(shape, dtype, 2, group_key, instance_key,
                                                timeout=timeout)


def merged_collective_options(ops: tf.distribute.CrossDeviceOps, options):
    """`options` (CommunicationOptions or None) over the CollectiveAllReduce's own, as TF merges them."""
    return ops._options.merge(options)  # pylint: disable=protected-access


def collective_timeout(strategy: tf.distribute.Strategy, options) -> float:
    """Seconds of `timeout_seconds` a collective of `strategy` runs with, given `options`
    (CommunicationOptions or None) merged over the strategy's `communication_options`, as
    TF merges them; 0 for none (also for strategies without communication options)."""
    own = getattr(strategy.extended, "_communication_options", None)  # pylint: disable=protected-access
    merged = own.merge(options) if own is not None else options
    return float(getattr(merged, "timeout_seconds", None) or 0)


def abort_collectives(code: int, message: str) -> None:
    """Ends every pending and later collective of this process with `code` and `message`
    (`context.context().abort_collective_ops`, what TF's MultiWorkerMirroredStrategy calls when its
    health check loses a peer); the collectives stay broken until the process ends."""
    check_tf_version()
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    context.context().abort_collective_ops(code, message)


def default_cross_device_ops(strategy: tf.distribute.Strategy) -> tf.distribute.CrossDeviceOps:
    """The cross-device ops `strategy` would use if no cross_device_ops were given.

    For `tf.distribute.MirroredStrategy` (TF 2.21): its CollectiveAllReduce over
    the local devices (RING on CPU, NCCL on physical GPUs), or
    ReductionToOneDevice for mixed CPU/GPU device lists.
    """
    check_tf_version()
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return strategy.extended._collective_ops  # pylint: disable=protected-access
    raise ValueError(
        f"GradientFlowAllReduce(cross_device_ops=None) takes the cross-device ops of "
        f"tf.distribute.MirroredStrategy or gf_tf.MultiWorkerMirroredStrategy, but the current "
        f"strategy is {type(strategy).__name__}. Pass cross_device_ops=... explicitly, e.g. "
        f"tf.distribute.ReductionToOneDevice(), or call it inside the strategy's scope.")




def cross_device_ops_of(strategy: tf.distribute.MultiWorkerMirroredStrategy
                        ) -> tf.distribute.CrossDeviceOps:
    """The cross-device ops `strategy` all-reduces with (its CollectiveAllReduce)."""
    check_tf_version()
    return strategy.extended._cross_device_ops  # pylint: disable=protected-access


def set_cross_device_ops(strategy: tf.distribute.MultiWorkerMirroredStrategy,
                         ops: tf.distribute.CrossDeviceOps) -> None:
    """Makes `strategy` all-reduce with `ops`; call before anything is traced under it."""
    check_tf_version()
    strategy.extended._cross_device_ops = ops  # pylint: disable=protected-access


def use_merge_call(strategy: tf.distribute.Strategy) -> bool:
    """`strategy.extended._use_merge_call()`: False only for XLA on all-GPU devices, where
    replica-context all-reduces run without merge_call (True for strategies without it)."""
    check_tf_version()
    use = getattr(strategy.extended, "_use_merge_call", None)
    return True if use is None else bool(use())


def strategy_cross_device_ops(strategy: tf.distribute.Strategy):
    """The cross-device ops object `strategy` was given or installed (None for others)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def local_variable(initial_value, device: str, name: str) -> tf.Variable:
    """A plain, non-trainable tf.Variable on `device`, even inside a strategy scope.

    tf.Variable() inside `strategy.scope()` (Keras enters it around fit)
    goes through the strategy's variable creator and becomes a
    MirroredVariable. Constructing the resource variable class directly skips
    the creator stack; TensorFlow's own cross-device ops create their helper
    variables the same way (cross_device_utils.CollectiveReplicaLauncher).
    """
    check_tf_version()
    with tf.init_scope(), tf.device(device):
        return _tf_resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


def in_saved_model_trace() -> bool:
    """True while `tf.saved_model.save` (or `model.export`) builds the SavedModel's graph."""
    check_tf_version()
    return _tf_save_context.in_save_context()


def in_xla_context() -> bool:
    """True while building a graph that XLA compiles (tf.function(jit_compile=True))."""
    if tf.executing_eagerly():
        return False
    return _tf_control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# --- failure detection -------------------------------------------------------

def configure_coordination_service(cluster, startup_seconds: Optional[float],
                                   heartbeat_seconds: Optional[float] = None) -> bool:
    """Makes every worker fail after `startup_seconds` if some peer has not started (joined the
    cluster) by then, and declare a peer lost after `heartbeat_seconds` without its heartbeats.

    TF 2.21's MultiWorkerMirroredStrategy starts TensorFlow's coordination
    service with `cluster_register_timeout_in_ms=0`, which waits for missing
    peers forever, and the default heartbeat timeout (10 s); it keeps a coordination service configured
    before it is created. This configures the same service (leader: the chief,
    or worker 0; jobs chief and worker) with these timeouts (None: TensorFlow's).
    `cluster` is a `gf_tf.cluster.Cluster` (its jobs and leader).

    Call before the strategy is created. Returns False (and changes nothing)
    if a coordination service was already configured in this process.
    """
    check_tf_version()
    try:   # TF 2.19+
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=import-outside-toplevel
    except ImportError:   # TF 2.18
        from tensorflow.tsl.protobuf import coordination_config_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    if context.context().coordination_service is not None:
        return False
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster.spec[job]))
            for job in ("chief", "worker") if job in cluster.spec]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=cluster.leader_task_name,
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int((startup_seconds or 0) * 1000),
        heartbeat_timeout_in_ms=int((heartbeat_seconds or 0) * 1000))
    return True


def wait_at_coordination_barrier(barrier_id: str, timeout_seconds: float) -> bool:
    """Blocks until every task of the coordination service reaches `barrier_id`.

    Returns False at once when this process has no coordination service (one worker,
    MirroredStrategy); True after the barrier. Raises TensorFlow's error when a task is
    unhealthy or the barrier times out (`tf.errors.DeadlineExceededError`).
    """
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    if context.context().coordination_service is None:
        return False
    context.context().wait_at_barrier(barrier_id, int(timeout_seconds * 1000))
    return True


def check_not_xla_across_devices(num_local_replicas: int) -> None:
    """Raises ValueError when a multi-device all-reduce is traced inside an XLA-compiled function.

    `model.compile(jit_compile=True)` under a MirroredStrategy with several
    CPU devices makes Keras compile each replica's step with XLA, and TF 2.21
    then fails at run time with "Trying to access resource ... located in
    device CPU:1 from device CPU:0" (TF's own cross-device ops fail the same
    way; tensorflow.org/xla/known_issues). Called at trace time, this stops
    the job at once with what to change instead.
    """
    if num_local_replicas > 1 and in_xla_context():
        raise ValueError(
            f"jit_compile=True does not work with {num_local_replicas} local replicas of a "
            f"MirroredStrategy in TensorFlow {tf.__version__}: XLA compiles each replica's step on one "
            f"device but the replicas' variables live on different devices. Compile the model with "
            f"jit_compile=False (model.compile(..., jit_compile=False)), or use one device per worker "
            f"(gf_tf.MultiWorkerMirroredStrategy with one replica per worker).")
