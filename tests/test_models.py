"""models.networks: every reference model builds, has its published size, and trains a step."""

import numpy as np
import pytest
import keras

from models import networks


def _train_steps(model, input_shape, num_classes, steps=1, batch=2, seed=0, run_eagerly=False):
    """Compiles with SGD and runs `steps` train_on_batch on one fixed random batch; returns the losses."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, num_classes, size=batch)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly)
    losses = []
    for _ in range(steps):
        model.reset_metrics()   # Keras < 3.15 returns the mean loss since the last reset, not the step's
        losses.append(float(model.train_on_batch(x, y)))
    return losses


@pytest.mark.parametrize("build, input_shape, num_classes", [
    (lambda s, n: networks.digits_cnn(s, n), (8, 8, 1), 10),
    (lambda s, n: networks.digits_cnn(s, n), (28, 28, 1), 10),
    (lambda s, n: networks.resnet_cifar(20, s, n), (32, 32, 3), 10),
    (lambda s, n: networks.resnet_cifar(56, s, n), (8, 8, 3), 3),
    (lambda s, n: networks.resnet50(s, n), (32, 32, 3), 5),
    (lambda s, n: networks.alexnet(s, n), (64, 64, 3), 5),
], ids=["digits_cnn_8", "digits_cnn_28", "resnet20", "resnet56", "resnet50", "alexnet"])
def test_model_runs_a_training_step_that_changes_every_trainable_weight(build, input_shape, num_classes):
    keras.utils.set_random_seed(0)
    model = build(input_shape, num_classes)
    assert model.output_shape == (None, num_classes)
    before = [w.numpy().copy() for w in model.trainable_weights]
    # One step: eager is several times faster than tracing the deep models.
    losses = _train_steps(model, input_shape, num_classes, run_eagerly=True)
    assert np.isfinite(losses).all()
    unchanged = [w.path for w, b in zip(model.trainable_weights, before)
                 if np.array_equal(w.numpy(), b)]
    assert not unchanged, f"weights without gradient: {unchanged}"


def test_digits_cnn_fits_a_small_batch():
    keras.utils.set_random_seed(0)
    model = networks.digits_cnn()
    losses = _train_steps(model, (8, 8, 1), 10, steps=30, batch=16)
    assert losses[-1] < 0.1 * losses[0], losses


@pytest.mark.parametrize("build, published", [
    (lambda: networks.resnet_cifar(20), 0.27e6),   # He et al. 2016, table 6
    (lambda: networks.resnet_cifar(32), 0.46e6),
    (lambda: networks.resnet_cifar(56), 0.85e6),
    (lambda: networks.resnet50(), 25.6e6),          # He et al. 2016 (Keras adds conv biases: +0.1%)
    (lambda: networks.alexnet(), 61.1e6),           # one-tower AlexNet (torchvision: 61,100,840)
], ids=["resnet20", "resnet32", "resnet56", "resnet50", "alexnet"])
def test_trainable_parameter_count_matches_the_published_figure(build, published):
    count = sum(int(np.prod(w.shape)) for w in build().trainable_weights)
    # Published figures have 2-3 significant digits.
    assert abs(count - published) / published < 0.01, count


def test_alexnet_has_torchvision_parameter_count_exactly():
    assert networks.alexnet().count_params() == 61_100_840


def test_resnet_cifar_rejects_a_depth_that_is_not_6n_plus_2():
    with pytest.raises(ValueError, match="6n\\+2"):
        networks.resnet_cifar(21)


def test_option_a_shortcut_pads_channels_with_zeros_around_the_input():
    x = np.random.default_rng(1).normal(size=(2, 3, 3, 16)).astype(np.float32)
    y = networks.PadChannels(32)(x).numpy()
    assert y.shape == (2, 3, 3, 32)
    np.testing.assert_array_equal(y[..., 8:24], x)
    assert not y[..., :8].any() and not y[..., 24:].any()
