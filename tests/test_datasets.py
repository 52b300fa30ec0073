"""models.datasets: every loader's values, and per-worker shards that are disjoint and complete."""

import io
import json
import os
import urllib.error

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import worker
from models import datasets, tfrecords


def _all(ds):
    """(images, labels) of a finite dataset of (image, label) pairs, as NumPy arrays."""
    images, labels = [], []
    for x, y in ds.as_numpy_iterator():
        images.append(x)
        labels.append(y)
    return np.stack(images), np.array(labels)


def _rows(images, labels):
    """Each example as a hashable (label, image bytes) pair."""
    return [(int(l), x.tobytes()) for x, l in zip(images, labels)]


def _check_shards_partition(source, split, num_shards):
    """Shards are pairwise disjoint and together are exactly the unsharded split."""
    full = _rows(*_all(source.examples(split)))
    shards = [_rows(*_all(source.examples(split, num_shards, i))) for i in range(num_shards)]
    assert sum(len(s) for s in shards) == len(full) == source.num_examples[split]
    assert sorted(sum(shards, [])) == sorted(full)
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not set(shards[i]) & set(shards[j]), (i, j)
    return shards


# --- digits ------------------------------------------------------------------------------

def test_digits_are_the_scikit_learn_images_scaled_to_unit_range():
    from sklearn.datasets import load_digits
    source = datasets.load_digits()
    assert source.input_shape == (8, 8, 1) and source.num_classes == 10
    assert source.num_examples == {"train": 1437, "test": 360}
    train_x, train_y = _all(source.examples("train"))
    test_x, test_y = _all(source.examples("test"))
    assert train_x.dtype == np.float32 and train_y.dtype == np.int32
    reference = load_digits()
    expected = sorted(_rows(reference.images[..., None].astype(np.float32) / 16.0, reference.target))
    assert sorted(_rows(train_x, train_y) + _rows(test_x, test_y)) == expected
    # Stratified split: every class in both.
    assert set(train_y) == set(test_y) == set(range(10))


def test_digits_shards_partition_the_training_set():
    shards = _check_shards_partition(datasets.load_digits(), "train", 2)
    assert [len(s) for s in shards] == [719, 718]


def test_digits_shard_i_holds_every_nth_example():
    source = datasets.load_digits()
    full_x, full_y = _all(source.examples("test"))
    for i in range(3):
        x, y = _all(source.examples("test", 3, i))
        np.testing.assert_array_equal(x, full_x[i::3])
        np.testing.assert_array_equal(y, full_y[i::3])


# --- mnist1d -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mnist1d():
    pytest.importorskip("mnist1d", reason="pip install '.[tasks]'")
    return datasets.load_mnist1d()


def test_mnist1d_is_the_packages_generated_set_as_float32_sequences(mnist1d):
    from mnist1d.data import get_dataset_args, make_dataset
    assert mnist1d.input_shape == (40, 1) and mnist1d.num_classes == 10
    assert mnist1d.num_examples == {"train": 4000, "test": 1000}
    reference = make_dataset(get_dataset_args())
    for split, (x_key, y_key) in {"train": ("x", "y"), "test": ("x_test", "y_test")}.items():
        x, y = _all(mnist1d.examples(split))
        assert x.dtype == np.float32 and y.dtype == np.int32 and x.shape == (len(y), 40, 1)
        np.testing.assert_array_equal(x[..., 0], reference[x_key].astype(np.float32))
        np.testing.assert_array_equal(y, reference[y_key])
        assert set(y) == set(range(10))


def test_mnist1d_is_the_same_for_every_seed_and_leaves_numpys_generator_alone(mnist1d):
    np.random.seed(7)
    expected_next = np.random.RandomState(7).rand()
    again = datasets.load_mnist1d(seed=3)
    assert np.random.rand() == expected_next   # make_dataset reseeds NumPy; the loader restores it
    np.testing.assert_array_equal(_all(again.examples("test"))[0], _all(mnist1d.examples("test"))[0])


def test_mnist1d_shards_partition_the_training_set(mnist1d):
    shards = _check_shards_partition(mnist1d, "train", 3)
    assert [len(s) for s in shards] == [1334, 1333, 1333]


def test_without_mnist1d_the_error_names_the_tasks_extra(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_mnist1d(name, *args, **kwargs):
        if name.startswith("mnist1d"):
            raise ImportError("No module named 'mnist1d'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mnist1d)
    with pytest.raises(datasets.DatasetUnavailable, match=r"gf_tf\[tasks\]"):
        datasets.load_mnist1d()


# --- synthetic ---------------------------------------------------------------------------

def test_synthetic_is_seeded_and_its_shards_are_slices_of_the_whole():
    source = datasets.load_synthetic((5, 4, 3), 7, num_train=11, num_test=3, seed=5)
    x, y = _all(source.examples("train"))
    assert x.shape == (11, 5, 4, 3) and x.dtype == np.float32
    assert ((0 <= x) & (x < 1)).all() and ((0 <= y) & (y < 7)).all()
    x_again, y_again = _all(datasets.load_synthetic((5, 4, 3), 7, 11, 3, seed=5).examples("train"))
    np.testing.assert_array_equal(x, x_again)
    np.testing.assert_array_equal(y, y_again)
    other_x, _ = _all(datasets.load_synthetic((5, 4, 3), 7, 11, 3, seed=6).examples("train"))
    assert not np.array_equal(x, other_x)
    for i in range(2):
        xi, yi = _all(source.examples("train", 2, i))
        np.testing.assert_array_equal(xi, x[i::2])
        np.testing.assert_array_equal(yi, y[i::2])
    test_x, _ = _all(source.examples("test"))
    assert test_x.shape[0] == 3 and not np.array_equal(test_x, x[:3])


# --- TFRecord directories ----------------------------------------------------------------

def _example(encoded: bytes, label: int) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    })).SerializeToString()


def _write_records(path, images, labels, encode=tf.io.encode_png):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for image, label in zip(images, labels):
            writer.write(_example(encode(image).numpy(), int(label)))


@pytest.fixture
def cifar_style_dir(tmp_path):
    """3 train files (5 + 5 + 4 records) and 1 test file (3 records) of 6x6 RGB PNGs, labels 0-4."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(17, 6, 6, 3), dtype=np.uint8)
    labels = rng.integers(0, 5, size=17)
    labels[0] = 4  # so the largest label (num_classes - 1) is known
    for f, (lo, hi) in enumerate([(0, 5), (5, 10), (10, 14)]):
        _write_records(tmp_path / f"train-{f:05d}-of-00003", images[lo:hi], labels[lo:hi])
    _write_records(tmp_path / "test-00000-of-00001", images[14:], labels[14:])
    return tmp_path, images, labels


def test_tfrecord_reads_counts_size_classes_and_exact_pixels(cifar_style_dir):
    data_dir, images, labels = cifar_style_dir
    source = tfrecords.load_tfrecord(str(data_dir))
    assert source.input_shape == (6, 6, 3) and source.num_classes == 5
    assert source.num_examples == {"train": 14, "test": 3}
    x, y = _all(source.examples("test"))
    np.testing.assert_array_equal(x, images[14:].astype(np.float32) / 255.0)
    np.testing.assert_array_equal(y, labels[14:])


def test_tfrecord_shards_by_file_when_there_are_enough_files(cifar_style_dir):
    data_dir, images, labels = cifar_style_dir
    source = tfrecords.load_tfrecord(str(data_dir))
    shards = _check_shards_partition(source, "train", 2)
    # Files 0 and 2 go to worker 0, file 1 to worker 1.
    expected_1 = sorted(_rows(images[5:10].astype(np.float32) / 255.0, labels[5:10]))
    assert sorted(shards[1]) == expected_1


def test_tfrecord_shards_by_record_when_files_are_fewer_than_workers(cifar_style_dir):
    data_dir, _, _ = cifar_style_dir
    _check_shards_partition(tfrecords.load_tfrecord(str(data_dir)), "test", 2)


def test_tfrecord_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="--data_dir must be a directory"):
        tfrecords.load_tfrecord(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no train files"):
        tfrecords.load_tfrecord(str(tmp_path))


def test_imagenet_layout_maps_labels_to_zero_based_and_resizes(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(6, 20, 24, 3), dtype=np.uint8)
    labels = np.array([1, 1000, 7, 3, 2, 500])
    for f in range(2):
        _write_records(tmp_path / f"train-{f:05d}-of-00002", images[3 * f:3 * f + 3],
                       labels[3 * f:3 * f + 3], encode=tf.io.encode_jpeg)
    _write_records(tmp_path / "validation-00000-of-00001", images[:2], labels[:2],
                   encode=tf.io.encode_jpeg)
    source = tfrecords.load_imagenet(str(tmp_path), image_size=16)
    assert source.input_shape == (16, 16, 3) and source.num_classes == 1000
    x, y = _all(source.examples("test"))
    assert x.shape == (2, 16, 16, 3) and np.isfinite(x).all()
    np.testing.assert_array_equal(y, [0, 999])
    shards = [_all(source.examples("train", 2, i, training=True))[1] for i in range(2)]
    assert sorted(np.concatenate(shards)) == sorted(labels - 1)


# --- keras.datasets sources offline --------------------------------------------------------

@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_download_failure_says_what_to_do(monkeypatch, name):
    import keras

    def offline():
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(getattr(keras.datasets, name), "load_data", offline)
    monkeypatch.delenv(worker.PRIVATE_NETWORK_ENV, raising=False)
    with pytest.raises(datasets.DatasetUnavailable, match=r"could not load .*--dataset digits"):
        getattr(datasets, f"load_{name}")()


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_download_failure_in_gf_tf_runs_private_network_says_host_network(monkeypatch, name):
    import keras

    def no_network():   # what keras.datasets raises there (Keras 3.15)
        raise Exception(f"URL fetch failure on https://storage.googleapis.com/{name}: None -- "
                        f"[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(getattr(keras.datasets, name), "load_data", no_network)
    monkeypatch.setenv(worker.PRIVATE_NETWORK_ENV, "1")   # as gf-tf-run -n sets it for its workers
    with pytest.raises(datasets.DatasetUnavailable) as error:
        getattr(datasets, f"load_{name}")()
    message = str(error.value)
    assert message.startswith(f"could not load {name} through keras.datasets (Exception: URL fetch failure")
    assert "[Errno -3] Temporary failure in name resolution). gf-tf-run -n runs the workers in a private " \
           "network namespace with only loopback" in message, message
    assert f"gf-tf-run -n 2 --host_network -- python -m models.train --dataset {name} ..." in message, message


# --- batching ----------------------------------------------------------------------------

def test_training_pipeline_repeats_full_batches_of_its_own_shard():
    source = datasets.load_synthetic((2, 2, 1), 3, num_train=10, num_test=2)
    ds = datasets.input_pipeline(source, "train", 4, num_shards=2, shard_index=1, training=True, seed=3)
    shard_x, _ = _all(source.examples("train", 2, 1))
    seen = set()
    for x, y in ds.take(5):  # 20 examples from a shard of 5: it repeats, never a short batch
        assert x.shape == (4, 2, 2, 1)
        seen.update(row.tobytes() for row in x.numpy())
    assert seen == {row.tobytes() for row in shard_x}


def test_evaluation_pipeline_keeps_the_last_partial_batch():
    source = datasets.load_synthetic((2, 2, 1), 3, num_train=10, num_test=7)
    sizes = [int(x.shape[0]) for x, _ in datasets.input_pipeline(source, "test", 4)]
    assert sizes == [4, 3]


def test_steps_per_epoch_is_full_global_batches():
    assert datasets.steps_per_epoch(1437, 64) == 22
    assert datasets.steps_per_epoch(64, 64) == 1
    with pytest.raises(ValueError, match="larger than the 10 examples"):
        datasets.steps_per_epoch(10, 64)


def test_bad_split_or_shard_is_an_error():
    source = datasets.load_synthetic((2, 2, 1), 3, num_train=4, num_test=2)
    with pytest.raises(ValueError, match="split must be one of"):
        source.examples("validation")
    with pytest.raises(ValueError, match="shard_index must be in 0-1"):
        source.examples("train", 2, 2)
