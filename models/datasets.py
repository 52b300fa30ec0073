"""Datasets for `models.train`, one loader per source, each worker reading its own shard.

Every loader returns a `Source`: metadata plus `examples(split, num_shards,
shard_index, training, seed)`, a `tf.data.Dataset` of unbatched
(image float32 (H, W, C), label int32 ()) pairs holding only shard
`shard_index` of `num_shards`. `input_pipeline` shuffles, repeats and batches
it; `distributed_dataset` wires it into a tf.distribute strategy so that each
worker (input pipeline) reads a disjoint shard with the per-replica batch size.

Training datasets repeat forever and every worker runs the same
`steps_per_epoch(num_examples, global_batch_size)` steps, so no worker waits
in a collective for another whose shard ran out early (uneven last batch).

Sources:
  digits    the 1797 8x8 handwritten digits bundled with scikit-learn (offline); 1437 train / 360 test.
  mnist1d   MNIST-1D (Greydanus 2020): 4000 train / 1000 test sequences of length 40, generated
            offline by the mnist1d package (pip install gf_tf[tasks]); never downloaded.
  mnist     28x28 digits through keras.datasets (downloads once to ~/.keras/datasets).
  cifar10   32x32 colour images through keras.datasets (downloads once).
  imagenet, tfrecord  TFRecord directories: models.tfrecords.
  synthetic seeded random images for throughput runs, at the model's input size.
"""

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from gf_tf import worker

TRAIN, TEST = "train", "test"


@dataclasses.dataclass(frozen=True)
class Source:
    """A dataset: metadata plus a function making one shard of one split.

    input_shape: shape of one float32 example: (height, width, channels) for images,
      (length, channels) for sequences (mnist1d).
    num_examples: examples per split ("train", "test") over all shards.
    """
    name: str
    input_shape: Tuple[int, ...]
    num_classes: int
    num_examples: Dict[str, int]
    _make: Callable[..., tf.data.Dataset]

    def examples(self, split: str, num_shards: int = 1, shard_index: int = 0,
                 training: bool = False, seed: int = 0) -> tf.data.Dataset:
        """Unbatched (image float32 input_shape, label int32 ()) of shard `shard_index` of `split`.

        Shards are disjoint and together hold the whole split. `training`
        turns on data augmentation where the source has one. Raises
        ValueError for an unknown split or a shard index out of range.
        """
        if split not in self.num_examples:
            raise ValueError(f"split must be one of {sorted(self.num_examples)}, got {split!r}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in 0-{num_shards - 1}, got {shard_index}")
        return self._make(split, num_shards, shard_index, training, seed)


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches in one pass over `num_examples` (the same on every worker).

    Raises ValueError if there is not a single full batch.
    """
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
    if num_examples < global_batch_size:
        raise ValueError(f"the global batch size {global_batch_size} is larger than the "
                         f"{num_examples} examples of the dataset; use a smaller --batch_size")
    return num_examples // global_batch_size


def input_pipeline(source: Source, split: str, batch_size: int, num_shards: int = 1,
                   shard_index: int = 0, training: bool = False, seed: int = 0) -> tf.data.Dataset:
    """Batches of `batch_size` from one shard; training: shuffled, augmented, repeated, full batches only."""
    ds = source.examples(split, num_shards, shard_index, training=training, seed=seed)
    if training:
        shard_size = -(-source.num_examples[split] // num_shards)
        ds = ds.shuffle(min(shard_size, 10_000), seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(batch_size, drop_remainder=training)
    options = tf.data.Options()
    # The shard is already this worker's: no second sharding by tf.distribute.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def nearest_multiples(value: int, divisor: int) -> Tuple[int, ...]:
    """The multiples of `divisor` just below and just above `value` (>= divisor), e.g. (63, 66) for 64, 3."""
    below = value // divisor * divisor
    return tuple(v for v in (below, below + divisor) if v >= divisor)


def distributed_dataset(strategy: tf.distribute.Strategy, source: Source, split: str,
                        global_batch_size: int, training: bool, seed: int = 0):
    """The split as a `tf.distribute.DistributedDataset` for `model.fit`.

    Each input pipeline (one per worker) reads shard `input_pipeline_id` of
    `num_input_pipelines` in batches of the per-replica size
    (global_batch_size / replicas; ValueError if it does not divide).
    """
    replicas = strategy.num_replicas_in_sync
    if global_batch_size % replicas:
        raise ValueError(f"--batch_size {global_batch_size} (global) must be divisible by the "
                         f"{replicas} replicas; nearest valid values: "
                         f"{', '.join(map(str, nearest_multiples(global_batch_size, replicas)))}")

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return input_pipeline(source, split, ctx.get_per_replica_batch_size(global_batch_size),
                              ctx.num_input_pipelines, ctx.input_pipeline_id, training, seed)

    return strategy.distribute_datasets_from_function(dataset_fn)


# ---------------------------------------------------------------------------------------------
# In-memory sources (digits, mnist, cifar10)

def _from_arrays(name, arrays: Dict[str, Tuple[np.ndarray, np.ndarray]], num_classes,
                 preprocess: Optional[Callable] = None, augment: Optional[Callable] = None) -> Source:
    """A Source over in-memory examples (N, ...) with a channel axis last, e.g. images
    (N, H, W, C) or sequences (N, L, C), and integer labels (N,) per split.

    preprocess maps a stored image to float32 (e.g. uint8 -> [0, 1]) inside
    tf.data, so large sets stay uint8 in memory; augment runs on training data.
    """
    for split, (x, y) in arrays.items():
        if x.ndim < 3 or len(x) != len(y):
            raise ValueError(f"{name} {split}: images {x.shape} and labels {y.shape} do not match")

    def make(split, num_shards, shard_index, training, seed):
        x, y = arrays[split]
        # Strided shard of the fixed example order: shard i holds examples i, i+n, i+2n, ...
        ds = tf.data.Dataset.from_tensor_slices((x[shard_index::num_shards],
                                                 y[shard_index::num_shards].astype(np.int32)))
        if preprocess is not None:
            ds = ds.map(lambda image, label: (preprocess(image), label),
                        num_parallel_calls=tf.data.AUTOTUNE)
        if training and augment is not None:
            ds = ds.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        return ds

    return Source(name, tuple(arrays[TRAIN][0].shape[1:]), num_classes,
                  {s: len(a[0]) for s, a in arrays.items()}, make)


def load_digits(seed: int = 0) -> Source:
    """scikit-learn's 1797 8x8 digits (UCI), pixels scaled from 0-16 to [0, 1]; a stratified 80/20 split.

    The split is fixed (random_state=0), independent of `seed`, so test
    accuracy is comparable across runs.
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, data.target, test_size=0.2, random_state=0, stratify=data.target)
    return _from_arrays("digits", {TRAIN: (x_train, y_train), TEST: (x_test, y_test)}, 10)


TASKS_EXTRA_HINT = "pip install 'gf_tf[tasks]' (or: pip install mnist1d scipy)"


def load_mnist1d(seed: int = 0) -> Source:
    """MNIST-1D (Greydanus 2020, arXiv 2011.14439): 10 classes of 1-D digit templates,
    shifted, scaled, sheared and noised; float32 sequences (40, 1), int32 labels 0-9.

    Generated offline by `mnist1d.data.make_dataset(mnist1d.data.get_dataset_args())`
    (5000 examples, the package's seed 42, standardised to mean 0 and std 1), split
    4000 train / 1000 test as the package does; the package's download path is never
    used. The data is fixed, independent of `seed`, so test accuracy is comparable
    across runs; NumPy's global random state is left as it was. Generation takes about
    5 s. Raises DatasetUnavailable naming the `tasks` extra if mnist1d (or scipy, which
    it needs) is not installed.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:
        raise DatasetUnavailable(f"--dataset mnist1d needs the mnist1d package ({e}): "
                                 f"{TASKS_EXTRA_HINT}") from e
    state = np.random.get_state()   # make_dataset seeds NumPy's global generator
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(state)
    as_sequences = lambda x: x.astype(np.float32)[..., None]
    return _from_arrays("mnist1d", {TRAIN: (as_sequences(data["x"]), data["y"]),
                                    TEST: (as_sequences(data["x_test"]), data["y_test"])}, 10)


TOPICS_VOCAB, TOPICS_LENGTH = 8000, 32


def load_topics(seed: int = 0) -> Source:
    """Topics: generated token sequences of 10 classes, a text-like task for an embedding table.

    Each sequence holds TOPICS_LENGTH tokens of a TOPICS_VOCAB-word vocabulary: each token is,
    independently, one of its class's 40 topic words with probability 0.15, one of another
    (random, per sequence) class's topic words with probability 0.05, else a background word
    drawn from a Zipf law (exponent 1.1) over the whole vocabulary. 5000 train / 1000 test
    sequences, stored as float32 (N, TOPICS_LENGTH, 1) token ids (exact below 2^24) with int
    labels 0-9. Generated offline by NumPy from a fixed seed (2026), independent of `seed`, so
    test accuracy is comparable across runs; NumPy's global random state is not touched.
    """
    del seed
    rng = np.random.default_rng(2026)
    classes, topic_words = 10, 40
    topics = rng.permutation(np.arange(1, TOPICS_VOCAB))[:classes * topic_words].reshape(
        classes, topic_words)
    zipf = 1.0 / np.arange(1, TOPICS_VOCAB + 1) ** 1.1
    background = rng.permutation(TOPICS_VOCAB)

    def split(n):
        y = rng.integers(0, classes, n)
        other = (y + rng.integers(1, classes, n)) % classes
        draw = rng.random((n, TOPICS_LENGTH))
        words = background[rng.choice(TOPICS_VOCAB, (n, TOPICS_LENGTH), p=zipf / zipf.sum())]
        own = topics[y[:, None], rng.integers(0, topic_words, (n, TOPICS_LENGTH))]
        confuser = topics[other[:, None], rng.integers(0, topic_words, (n, TOPICS_LENGTH))]
        tokens = np.where(draw < 0.15, own, np.where(draw < 0.2, confuser, words))
        return tokens.astype(np.float32)[..., None], y

    return _from_arrays("topics", {TRAIN: split(5000), TEST: split(1000)}, classes)


class DatasetUnavailable(RuntimeError):
    """A dataset could not be loaded (e.g. a download failed offline); the message says what to do."""


def _download(name, load_data):
    """load_data(); DatasetUnavailable saying what to do if it fails (under gf-tf-run -n: --host_network)."""
    try:
        return load_data()
    except Exception as e:  # URLError, OSError, ... depending on how the network fails
        if worker.in_private_network():   # "[Errno -3] Temporary failure in name resolution"
            advice = (f"{worker.HOST_NETWORK_HINT} (gf-tf-run -n 2 --host_network -- python -m models.train "
                      f"--dataset {name} ...), or download it once outside gf-tf-run: "
                      f"python -c \"import keras; keras.datasets.{name}.load_data()\"")
        else:
            advice = ("It downloads once into ~/.keras/datasets; offline, copy the file there from a "
                      "machine that has it, or use --dataset digits (bundled with scikit-learn, no download)")
        raise DatasetUnavailable(
            f"could not load {name} through keras.datasets ({type(e).__name__}: {e}). {advice}.") from e


def load_mnist(seed: int = 0) -> Source:
    """MNIST 28x28x1 (60000 train / 10000 test) through keras.datasets, pixels in [0, 1]."""
    import keras
    (x_train, y_train), (x_test, y_test) = _download("mnist", keras.datasets.mnist.load_data)
    return _from_arrays("mnist", {TRAIN: (x_train[..., None], y_train), TEST: (x_test[..., None], y_test)},
                        10, preprocess=lambda x: tf.cast(x, tf.float32) / 255.0)


def _cifar_augment(image, label):
    """Pad 4 pixels, random 32x32 crop, random horizontal flip (He et al. 2016, sec. 4.2)."""
    image = tf.image.resize_with_crop_or_pad(image, 40, 40)
    image = tf.image.random_crop(image, tf.shape(image) - [8, 8, 0])
    return tf.image.random_flip_left_right(image), label


def load_cifar10(seed: int = 0) -> Source:
    """CIFAR-10 32x32x3 (50000 / 10000) through keras.datasets, per-channel standardised."""
    import keras
    (x_train, y_train), (x_test, y_test) = _download("cifar10", keras.datasets.cifar10.load_data)
    mean = tf.constant(x_train.mean(axis=(0, 1, 2)), tf.float32)
    std = tf.constant(x_train.std(axis=(0, 1, 2)), tf.float32)
    return _from_arrays("cifar10", {TRAIN: (x_train, y_train.ravel()), TEST: (x_test, y_test.ravel())},
                        10, preprocess=lambda x: (tf.cast(x, tf.float32) - mean) / std,
                        augment=_cifar_augment)


def load_synthetic(input_shape, num_classes, num_train: int = 2560, num_test: int = 256,
                   seed: int = 0) -> Source:
    """Seeded random images (uniform [0, 1), `input_shape`) and labels, for throughput runs.

    Example i of a split is a pure function of (seed, split, i), so shards can
    be checked against each other and runs are repeatable.
    """
    split_ids = {TRAIN: 0, TEST: 1}
    input_shape = tuple(int(d) for d in input_shape)

    def make(split, num_shards, shard_index, training, _seed):
        def example(i):
            key = tf.stack([tf.constant(seed, tf.int64), split_ids[split] * (1 << 32) + i])
            image = tf.random.stateless_uniform(input_shape, seed=key)
            label = tf.random.stateless_uniform([], seed=key + 1, maxval=num_classes, dtype=tf.int32)
            return image, label
        count = {TRAIN: num_train, TEST: num_test}[split]
        return tf.data.Dataset.range(count).shard(num_shards, shard_index).map(
            example, num_parallel_calls=tf.data.AUTOTUNE)

    return Source("synthetic", input_shape, num_classes, {TRAIN: num_train, TEST: num_test}, make)
