"""Flag values -> objects: models, datasets, strategies, GradientFlow, precision policies.

One table per kind and one `choose` for all of them, so every unknown value
fails the same way: a ValueError naming the flag and listing the valid values.
"""

from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import keras
import tensorflow as tf

import gf_tf
from gf_tf import cluster
from models import datasets, networks, tfrecords

# name -> (builder(input_shape, num_classes), default input shape (used by --dataset synthetic))
MODELS: Dict[str, Tuple[Callable[..., keras.Model], Tuple[int, ...]]] = {
    "digits_cnn": (networks.digits_cnn, (8, 8, 1)),
    "resnet20": (lambda s, n: networks.resnet_cifar(20, s, n), (32, 32, 3)),
    "resnet32": (lambda s, n: networks.resnet_cifar(32, s, n), (32, 32, 3)),
    "resnet56": (lambda s, n: networks.resnet_cifar(56, s, n), (32, 32, 3)),
    "resnet50": (networks.resnet50, (224, 224, 3)),
    "alexnet": (networks.alexnet, (224, 224, 3)),
    "mnist1d_cnn": (networks.mnist1d_cnn, (40, 1)),
    "wide_mlp": (networks.wide_mlp, (40, 1)),
    "topic_attention": (networks.topic_attention, (32, 1)),
}

# name -> loader(data_dir, model_input_shape, seed) -> datasets.Source
DATASETS: Dict[str, Callable[[str, Tuple[int, int, int], int], datasets.Source]] = {
    "digits": lambda data_dir, shape, seed: datasets.load_digits(seed),
    "mnist": lambda data_dir, shape, seed: datasets.load_mnist(seed),
    "cifar10": lambda data_dir, shape, seed: datasets.load_cifar10(seed),
    "imagenet": lambda data_dir, shape, seed: tfrecords.load_imagenet(data_dir, seed),
    "tfrecord": lambda data_dir, shape, seed: tfrecords.load_tfrecord(data_dir, seed),
    "synthetic": lambda data_dir, shape, seed: datasets.load_synthetic(
        shape, 1000 if shape[0] >= 128 else 10, seed=seed),
    "mnist1d": lambda data_dir, shape, seed: datasets.load_mnist1d(seed),
    "mnist1d_wide": lambda data_dir, shape, seed: datasets.load_mnist1d(seed),
    "topics": lambda data_dir, shape, seed: datasets.load_topics(seed),
}

# dataset -> the model --model "" (its default) trains on it; "mnist1d_wide" is mnist1d's data
# for the wide MLP, the task with a large dense layer.
DATASET_MODELS = {"mnist1d": "mnist1d_cnn", "mnist1d_wide": "wide_mlp", "topics": "topic_attention"}
DEFAULT_MODEL = "digits_cnn"   # every other dataset's


def model_for(model: str, dataset: str) -> str:
    """--model if given (not ""), else the dataset's model (DATASET_MODELS, or DEFAULT_MODEL)."""
    return model or DATASET_MODELS.get(dataset, DEFAULT_MODEL)


STRATEGIES = ("multi_worker_mirrored", "mirrored", "one_device")
# flag value -> GradientFlowAllReduce argument of the same name ("auto": the planner chooses;
# models/train.py's enum flags list the same values, so a typo fails before TensorFlow starts)
COMPRESSIONS = {"fp16": "fp16", "bf16": "bf16", "none": None, "auto": "auto"}
ALGORITHMS = {"auto": "auto", "ring": "ring", "recursive_doubling": "recursive_doubling"}
OVERLAPS = {"auto": "auto", "true": True, "false": False}
REDUCERS = {"default": "default", "lowrank": "lowrank"}
MIXED_PRECISION = {"none": "float32", "mixed_float16": "mixed_float16",
                   "mixed_bfloat16": "mixed_bfloat16"}


def choose(flag: str, value: str, table: Mapping):
    """table[value]; ValueError "unknown --flag 'value'; valid values: ..." otherwise."""
    if value not in table:
        raise ValueError(f"unknown --{flag} {value!r}; valid values: {', '.join(table)}")
    return table[value]


def build_model(name: str, input_shape, num_classes: int) -> keras.Model:
    """An uncompiled reference model (see models.networks) for these inputs."""
    builder, _ = choose("model", name, MODELS)
    return builder(tuple(input_shape), num_classes)


def default_input_shape(model: str) -> Tuple[int, ...]:
    """The input shape a model was designed for (what --dataset synthetic generates)."""
    return choose("model", model, MODELS)[1]


def load_dataset(name: str, data_dir: str = "", model: str = "digits_cnn",
                 seed: int = 0) -> datasets.Source:
    """The dataset source; `model` only sets the synthetic image size."""
    loader = choose("dataset", name, DATASETS)
    return loader(data_dir, default_input_shape(model), seed)


def set_precision(policy: str) -> None:
    """Sets the global Keras dtype policy (float32, mixed_float16 or mixed_bfloat16)."""
    keras.mixed_precision.set_global_policy(choose("mixed_precision", policy, MIXED_PRECISION))


def configure_local_devices(num_devices: int) -> None:
    """Splits the CPU into `num_devices` logical devices (one replica each).

    Must run before TensorFlow initialises its devices (before any op runs).
    """
    if num_devices < 1:
        raise ValueError(f"--num_devices must be >= 1, got {num_devices}")
    if num_devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)


def parse_density(text: Union[str, float]) -> Union[float, str]:
    """--density as ChunkSparsity takes it: "auto" (any case), a float, or the text itself if neither.

    Parses only; `gf_tf.ChunkSparsity` checks the value (in `build_gradient_flow`).
    """
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        return text


def uses_csc(density: Union[float, str]) -> bool:
    """True if --density asks for CSC: anything but 1 (ChunkSparsity rejects what is not in (0, 1] or "auto")."""
    return density != 1.0


def split_momentum(momentum: float, momentum_correction: bool,
                   density: Union[float, str]) -> Tuple[float, float]:
    """(CSC momentum correction, optimizer momentum) for --momentum and --momentum_correction.

    With CSC (`uses_csc(density)`) and momentum_correction the momentum goes into
    `gf_tf.ChunkSparsity(momentum=)` and the optimizer runs plain SGD (DGC's
    momentum correction, the paper's setting); otherwise the optimizer keeps it and
    CSC, if any, is plain error feedback.
    """
    if momentum_correction and uses_csc(density):
        return momentum, 0.0
    return 0.0, momentum


def build_gradient_flow(compression: str = "fp16", bytes_per_pack: Union[int, str] = 4 << 20,
                        density: Union[float, str] = 1.0, chunk_size: int = 1024,
                        warmup_steps: int = 0, momentum: float = 0.0, selection: str = "per_pack",
                        algorithm: str = "auto", overlap: str = "false",
                        scoring: str = "error_feedback", reducer: str = "default", rank: int = 2,
                        lowrank_alternate: bool = False):
    """A gf_tf.GradientFlowAllReduce for these flags, or None for TF's own all-reduce.

    compression, algorithm, overlap: the flag values ("fp16", "bf16", "none" or "auto";
    "auto", "ring" or "recursive_doubling"; "auto", "true" or "false"), passed as
    GradientFlowAllReduce(compression=..., algorithm=..., overlap=...) ("none": None,
    "true"/"false": True/False).
    density: --density as given (text or number), parsed here once; 1 means
    dense (no CSC); "auto" means CSC with ChunkSparsity(density="auto");
    --compression none with density 1 means plain TF (float32, TF's packing),
    unless --algorithm or --overlap asks for GradientFlow's (then a float32 wire).
    momentum: CSC momentum correction (the optimizer must then run without
    momentum). selection: CSC's top-k "per_pack", "global" or "ahead"; scoring: "ahead"'s
    next-step score, "error_feedback" or "paper". reducer: "default" (dense, or CSC by
    density) or "lowrank" (`gf_tf.reducers.LowRank(rank=rank, alternate=lowrank_alternate,
    warmup_steps=warmup_steps)`, not with CSC; `lowrank_alternate`: one factor all-reduce a
    step, ACP-SGD). warmup_steps: the dense steps before CSC or low rank starts. The CSC flags
    are checked by gf_tf.ChunkSparsity, even for a dense run, and its
    ValueError names the flag ("--density must be a fraction in (0, 1] ...");
    bytes_per_pack: wire bytes per pack, or "auto" (the planner's);
    also ValueError for a negative bytes_per_pack, an unknown compression, algorithm,
    overlap or reducer, a bad rank, or --reducer lowrank with CSC.
    """
    wire = choose("compression", compression, COMPRESSIONS)
    algorithm = choose("algorithm", algorithm, ALGORITHMS)
    overlap = choose("overlap", overlap, OVERLAPS)
    density = parse_density(density)
    if bytes_per_pack != "auto" and bytes_per_pack < 0:
        raise ValueError(f"--bytes_per_pack must be >= 0 (wire bytes; 0 = one pack per dtype), "
                         f"got {bytes_per_pack}")
    try:   # every ChunkSparsity argument used here is the flag of the same name
        settings = gf_tf.ChunkSparsity(density=density, chunk_size=chunk_size, warmup_steps=warmup_steps,
                                       momentum=momentum if uses_csc(density) else 0.0, selection=selection,
                                       scoring=scoring)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    sparsity = settings if uses_csc(density) else None
    own_reducer = _reducer(choose("reducer", reducer, REDUCERS), rank, lowrank_alternate,
                           warmup_steps, sparsity)
    if (wire is None and sparsity is None and own_reducer is None and algorithm == "auto"
            and overlap is False):
        return None
    return gf_tf.GradientFlowAllReduce(compression=wire, bytes_per_pack=bytes_per_pack,
                                       sparsity=sparsity, algorithm=algorithm, overlap=overlap,
                                       reducer=own_reducer)


def _reducer(name: str, rank: int, alternate: bool, warmup_steps: int,
             sparsity) -> Optional[gf_tf.reducers.Reducer]:
    """The --reducer's object: None for "default" (dense, or CSC's by --density)."""
    if name == "default":
        return None
    if sparsity is not None:
        raise ValueError("--reducer lowrank cannot be combined with CSC: pass --density 1")
    try:
        return gf_tf.reducers.LowRank(rank=rank, alternate=alternate, warmup_steps=warmup_steps)
    except ValueError as e:
        raise ValueError(f"--{e}") from None


# --tf_all_reduce_dtype: the dtype TF's own all-reduce carries the gradients in (no GradientFlow)
TF_ALL_REDUCE_DTYPES = ("float32", "float16")


@keras.saving.register_keras_serializable(package="gf_tf_models")
class Float16AllReduceSGD(keras.optimizers.SGD):
    """SGD whose gradients cross TensorFlow's own all-reduce as float16: the 16-bit dense baseline.

    In replica context each gradient is cast to float16, summed over the
    replicas by `ReplicaContext.all_reduce` (TensorFlow's collectives: its
    packing, its ring) and cast back to its variable's dtype; then, in
    cross-replica context (`merge_call`, where nothing is all-reduced again),
    SGD's own `update_step` updates every variable with the summed gradient and
    `iterations` advances, as `keras.optimizers.SGD.apply` does. Only the
    gradients travel in float16; any other all-reduce of the step (metrics,
    BatchNormalization) stays TensorFlow's as it is. A float16 sum overflows
    beyond 65504 and loses gradients below about 6e-8 (no scaling: the plain
    cast a 16-bit baseline uses). Without a strategy step (no replica context,
    or the default strategy) it is `keras.optimizers.SGD`; gradient clipping,
    weight decay, EMA and gradient accumulation are not supported (ValueError).
    Takes SGD's arguments.
    """

    def apply(self, grads, trainable_variables=None):
        replica = tf.distribute.get_replica_context()
        if replica is None or not tf.distribute.has_strategy():
            return super().apply(grads, trainable_variables)
        if (self.clipnorm or self.clipvalue or self.global_clipnorm or self.weight_decay
                or self.use_ema or self.gradient_accumulation_steps):
            raise ValueError("Float16AllReduceSGD: clipping, weight decay, EMA and gradient "
                             "accumulation are not supported")
        variables = list(trainable_variables)
        if not self.built:
            self.build(variables)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        reduced = replica.all_reduce(tf.distribute.ReduceOp.SUM,
                                     [tf.cast(g, tf.float16) for g, _ in pairs])
        pairs = [(tf.cast(r, v.dtype), v) for r, (_, v) in zip(reduced, pairs)]

        def update(strategy):
            learning_rate = self.learning_rate
            for grad, variable in pairs:
                strategy.extended.update(variable.value, lambda var, g: self.update_step(g, var, learning_rate),
                                         args=(grad,), group=False)
            self.iterations.assign_add(1)

        replica.merge_call(update)
        return self.iterations


def build_optimizer(learning_rate, momentum: float = 0.0,
                    tf_all_reduce_dtype: str = "float32") -> keras.optimizers.Optimizer:
    """keras.optimizers.SGD(learning_rate, momentum), or Float16AllReduceSGD for "float16".

    learning_rate: a float or a keras LearningRateSchedule. Raises ValueError
    "unknown --tf_all_reduce_dtype ..." for another dtype.
    """
    choose("tf_all_reduce_dtype", tf_all_reduce_dtype, {d: d for d in TF_ALL_REDUCE_DTYPES})
    cls = Float16AllReduceSGD if tf_all_reduce_dtype == "float16" else keras.optimizers.SGD
    return cls(learning_rate, momentum=momentum)


def build_strategy(name: str, num_devices: int = 1, gradient_flow=None,
                   timeout_seconds: float = 300.0,
                   startup_timeout_seconds: float = 300.0,
                   heartbeat_timeout_seconds: Optional[float] = None) -> tf.distribute.Strategy:
    """The tf.distribute strategy for --strategy, with GradientFlow installed when given.

    multi_worker_mirrored: gf_tf.MultiWorkerMirroredStrategy over the cluster in
      TF_CONFIG (checked first with gf_tf.cluster.validate_tf_config; without
      TF_CONFIG a one-worker cluster of this process), each worker with
      `num_devices` CPU replicas.
    mirrored: tf.distribute.MirroredStrategy over `num_devices` logical CPUs
      (gradient_flow None: TensorFlow's default cross-device ops).
    one_device: tf.distribute.OneDeviceStrategy on the CPU (no all-reduce;
      gradient_flow must be None).
    Collectives fail after `timeout_seconds` instead of hanging; a worker whose peers
    have not all started after `startup_timeout_seconds` fails naming them; a peer is given up
    after `heartbeat_timeout_seconds` without heartbeats (None: TensorFlow's 10 s).
    """
    choose("strategy", name, {s: s for s in STRATEGIES})
    devices = [f"/cpu:{i}" for i in range(num_devices)]
    if name == "one_device":
        if gradient_flow is not None:
            raise ValueError("--strategy one_device has no all-reduce to compress; use "
                             "--compression none --density 1, or --strategy mirrored --num_devices 2")
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=gradient_flow)
    cluster.from_tf_config()   # a malformed TF_CONFIG fails here, naming the field
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return gf_tf.MultiWorkerMirroredStrategy(communication_options=options,
                                             gradient_flow=gradient_flow,
                                             peer_startup_timeout=startup_timeout_seconds,
                                             heartbeat_timeout=heartbeat_timeout_seconds)


def task_info(strategy: tf.distribute.Strategy) -> Tuple[Optional[str], int, bool]:
    """(task_type, task_id, is_chief) of this process, as in TF's multi-worker guide.

    The chief is task "chief", or worker 0 when the cluster has no chief; a
    process outside any cluster is its own chief (gf_tf.cluster.Cluster.is_chief).
    """
    this = cluster.of_strategy(strategy)
    return this.task_type, this.task_index, this.is_chief


def tf_config_summary() -> str:
    """One line describing the TF_CONFIG of this process, for logs."""
    this = cluster.from_tf_config()
    if this.task_type is None:
        return "TF_CONFIG not set"
    return f"task {this.task_type}:{this.task_index} of { {job: list(a) for job, a in this.spec.items()} }"
