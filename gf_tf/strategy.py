"""gf_tf.MultiWorkerMirroredStrategy, and every private TensorFlow attribute gf_tf touches.

TensorFlow offers no public way to choose the cross-device ops of
`tf.distribute.MultiWorkerMirroredStrategy`, nor to build the `PerReplica` /
`Mirrored` values a `tf.distribute.CrossDeviceOps` exchanges. The private
pieces used for that live here and only here, behind `check_tf_version`:

- `tensorflow.python.distribute.values.PerReplica`, `distribute_utils.regroup`
  (to build and return distributed values),
- `tensorflow.python.distribute.cross_device_ops._all_devices_match`,
- `CrossDeviceOps._num_between_graph_workers` (workers in the collective group),
  `CrossDeviceOps._all_reduce` and `._gather_implementation` of the wrapped ops
  (GradientFlowAllReduce overrides the same methods, as TF's contract asks),
- `MirroredStrategy.extended._collective_ops` (the ops TF uses by default),
- `MultiWorkerMirroredStrategy.extended._cross_device_ops` (replaced after
  construction, before anything is traced).
"""

import dataclasses
from typing import List, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _tf_cross_device_ops
from tensorflow.python.distribute import distribute_utils as _tf_distribute_utils
from tensorflow.python.distribute import values as _tf_values

from gf_tf import cross_device_ops, keras_compat

TESTED_TF_VERSIONS = ("2.21",)


def check_tf_version(version: str = None) -> None:
    """Raises RuntimeError unless TensorFlow is a version gf_tf's wiring was tested with."""
    version = version or tf.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_TF_VERSIONS:
        raise RuntimeError(
            f"gf_tf touches private tf.distribute internals and was tested with TensorFlow "
            f"{', '.join(TESTED_TF_VERSIONS)}.x only; found TensorFlow {version}. "
            f"Install tensorflow-cpu=={TESTED_TF_VERSIONS[-1]}.* or port gf_tf/strategy.py.")


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Where this process sits among the workers of a collective group."""
    rank: int                  # 0 .. num_workers - 1, chief first
    names: Tuple[str, ...]     # e.g. ("worker 0", "worker 1"), by rank

    @property
    def num_workers(self) -> int:
        return len(self.names)


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


def destinations_match(value_destination_pairs) -> bool:
    """True if every value is all-reduced in place (destinations = the value's devices)."""
    return _tf_cross_device_ops._all_devices_match(value_destination_pairs)  # pylint: disable=protected-access


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
        check_tf_version()
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
            extended = self.extended
            gradient_flow._attach(extended._cross_device_ops, _worker_info(self))  # pylint: disable=protected-access
            extended._cross_device_ops = gradient_flow  # pylint: disable=protected-access


def _worker_info(strategy) -> WorkerInfo:
    """Rank and names of the workers, chief first, from the public cluster resolver."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict() if resolver else {}
    tasks = [(job, i) for job in ("chief", "worker") for i in range(len(spec.get(job, [])))]
    if not tasks or resolver.task_type not in ("chief", "worker"):
        return WorkerInfo(rank=0, names=("worker 0",))
    names = tuple(f"{job} {i}" for job, i in tasks)
    return WorkerInfo(rank=tasks.index((resolver.task_type, int(resolver.task_id))), names=names)
