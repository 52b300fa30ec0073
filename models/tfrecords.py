"""TFRecord sources for `models.train` (a `models.datasets.Source` each, sharded by whole files).

  imagenet  a TFRecord directory in the layout of TF's build_imagenet_data.py:
            train-*-of-* and validation-*-of-* with image/encoded (JPEG) and
            image/class/label (1-1000); 224x224 crops.
  tfrecord  any TFRecord directory with train* and test*/validation* files of
            image/encoded (JPEG/PNG) and image/class/label (0-based) at one image size
            (e.g. CIFAR); counts, size and classes are read from the files.
"""

import glob
import os

import tensorflow as tf

from models.datasets import TEST, TRAIN, Source

_FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
             "image/class/label": tf.io.FixedLenFeature([], tf.int64)}


def _record_files(data_dir: str, patterns) -> list:
    for pattern in patterns:
        files = sorted(glob.glob(os.path.join(data_dir, pattern)))
        if files:
            return files
    return []


def _tfrecord_source(name, data_dir, split_patterns, input_shape, num_classes, num_examples,
                     decode) -> Source:
    files = {split: _record_files(data_dir, patterns) for split, patterns in split_patterns.items()}

    def make(split, num_shards, shard_index, training, seed):
        split_files = files[split]
        if len(split_files) >= num_shards:
            # Whole files per shard: each file is read by exactly one worker.
            ds = tf.data.Dataset.from_tensor_slices(split_files[shard_index::num_shards])
            if training:
                ds = ds.shuffle(len(split_files), seed=seed)
            ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=4,
                               num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        else:
            # Fewer files than workers: every worker reads all, keeps every num_shards-th record.
            ds = tf.data.TFRecordDataset(split_files).shard(num_shards, shard_index)
        return ds.map(lambda record: decode(tf.io.parse_single_example(record, _FEATURES), training),
                      num_parallel_calls=tf.data.AUTOTUNE)

    return Source(name, input_shape, num_classes, num_examples, make)


def _count_and_inspect(files):
    """(record count, largest label, image shape of the first record) of TFRecord files."""
    count, max_label, shape = 0, -1, None
    for record in tf.data.TFRecordDataset(files):
        example = tf.io.parse_single_example(record, _FEATURES)
        if shape is None:
            shape = tuple(tf.io.decode_image(example["image/encoded"]).shape)
        max_label = max(max_label, int(example["image/class/label"]))
        count += 1
    return count, max_label, shape


def load_tfrecord(data_dir: str, seed: int = 0) -> Source:
    """A CIFAR-style TFRecord directory: train* and test* (or validation*) files of
    image/encoded (JPEG or PNG, all one size) and image/class/label (int64, 0-based).

    Record counts, image size and the number of classes (largest label + 1)
    are read from the files once. Pixels are scaled to [0, 1]; training adds
    random horizontal flips. Raises ValueError if files or features are missing.
    """
    patterns = {TRAIN: ["train*"], TEST: ["test*", "validation*", "val*"]}
    if not data_dir or not os.path.isdir(data_dir):
        raise ValueError(f"--data_dir must be a directory of TFRecord files for --dataset tfrecord, "
                         f"got {data_dir!r}")
    counts, labels, shapes = {}, [], []
    for split, split_patterns in patterns.items():
        files = _record_files(data_dir, split_patterns)
        if not files:
            raise ValueError(f"no {split} files in --data_dir {data_dir!r}: expected names matching "
                             f"{' or '.join(split_patterns)}")
        counts[split], max_label, shape = _count_and_inspect(files)
        labels.append(max_label)
        shapes.append(shape)
    if shapes[0] != shapes[1] or None in shapes:
        raise ValueError(f"train and test images in {data_dir!r} differ in shape: {shapes}")
    shape = shapes[0]

    def decode(example, training):
        image = tf.io.decode_image(example["image/encoded"], channels=shape[-1], expand_animations=False)
        image = tf.ensure_shape(tf.cast(image, tf.float32) / 255.0, shape)
        if training:
            image = tf.image.random_flip_left_right(image)
        return image, tf.cast(example["image/class/label"], tf.int32)

    return _tfrecord_source("tfrecord", data_dir, patterns, shape, max(labels) + 1, counts, decode)


# Plain lists: a tf.constant at import time would initialise TF's devices too early.
_IMAGENET_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
_IMAGENET_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def load_imagenet(data_dir: str, seed: int = 0, image_size: int = 224) -> Source:
    """ImageNet-1k as TFRecords from TF's build_imagenet_data.py: train-* / validation-*,
    JPEG image/encoded, image/class/label 1-1000 (mapped to 0-999).

    Training: a random crop covering 8-100% of the image (aspect 3/4-4/3),
    resized to image_size, random flip; evaluation: central 87.5% crop, resized.
    Standardised with the usual ImageNet channel mean/std. 1281167 / 50000 examples.
    """
    patterns = {TRAIN: ["train-*"], TEST: ["validation-*"]}
    for split, split_patterns in patterns.items():
        if not _record_files(data_dir or "", split_patterns):
            raise ValueError(f"--data_dir {data_dir!r} has no ImageNet {split} files "
                             f"({split_patterns[0]}); see TF models' build_imagenet_data.py")

    def decode(example, training):
        image = tf.io.decode_jpeg(example["image/encoded"], channels=3)
        if training:
            begin, size, _ = tf.image.sample_distorted_bounding_box(
                tf.shape(image), tf.zeros([0, 0, 4]), min_object_covered=0.1,
                aspect_ratio_range=(0.75, 1.33), area_range=(0.08, 1.0), max_attempts=10,
                use_image_if_no_bounding_boxes=True)
            image = tf.image.random_flip_left_right(tf.slice(image, begin, size))
        else:
            image = tf.image.central_crop(image, 0.875)
        image = tf.image.resize(image, [image_size, image_size])
        image = (image - _IMAGENET_MEAN) / _IMAGENET_STD
        return image, tf.cast(example["image/class/label"], tf.int32) - 1

    return _tfrecord_source("imagenet", data_dir, patterns, (image_size, image_size, 3), 1000,
                            {TRAIN: 1281167, TEST: 50000}, decode)


# ---------------------------------------------------------------------------------------------
# Synthetic
