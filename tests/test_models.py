"""models.networks: every reference model builds, has its published size, and trains a step.
models.factory and models.train: the planner's flags (--compression auto, --algorithm, --overlap)
become GradientFlowAllReduce's arguments of the same name, and a bad value fails before TensorFlow
is imported."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import keras
from absl import flags

import gf_tf
from gf_tf import collectives
from models import factory, networks, train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    (lambda s, n: networks.mnist1d_cnn(s, n), (40, 1), 10),
    (lambda s, n: networks.wide_mlp(s, n, width=64), (40, 1), 10),
], ids=["digits_cnn_8", "digits_cnn_28", "resnet20", "resnet56", "resnet50", "alexnet", "mnist1d_cnn",
        "wide_mlp"])
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


def test_the_mnist1d_models_have_their_documented_sizes():
    cnn = networks.mnist1d_cnn()
    # 3 convolutions of 25 filters of width 5 (no bias), batch norm (gamma, beta), a dense head on 5 x 25.
    assert sum(int(np.prod(w.shape)) for w in cnn.trainable_weights) == \
        5 * 25 + 2 * 5 * 25 * 25 + 3 * 2 * 25 + 5 * 25 * 10 + 10 == 7_785
    mlp = networks.wide_mlp()
    assert [tuple(w.shape) for w in mlp.trainable_weights] == \
        [(40, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
    assert mlp.count_params() == 1_101_834


@pytest.mark.parametrize("model, dataset, expected", [
    ("", "mnist1d", "mnist1d_cnn"), ("", "mnist1d_wide", "wide_mlp"), ("", "digits", "digits_cnn"),
    ("", "cifar10", "digits_cnn"), ("wide_mlp", "mnist1d", "wide_mlp"), ("resnet20", "digits", "resnet20"),
])
def test_the_dataset_picks_its_model_and_model_overrides_it(model, dataset, expected):
    assert factory.model_for(model, dataset) == expected
    assert expected in factory.MODELS


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


# --- the planner's flags: models.train -> models.factory -> GradientFlowAllReduce -----------

@pytest.mark.parametrize("flag, table", [("compression", factory.COMPRESSIONS),
                                         ("algorithm", factory.ALGORITHMS),
                                         ("overlap", factory.OVERLAPS)])
def test_the_enum_flags_take_the_factorys_values(flag, table):
    assert train.FLAGS[flag].parser.enum_values == list(table)


def test_every_algorithm_flag_value_is_auto_or_a_registered_algorithm():
    assert factory.ALGORITHMS["auto"] == "auto"
    assert all(name in collectives.ALGORITHMS for name in factory.ALGORITHMS if name != "auto")


def test_the_main_jobs_defaults_stay_fp16_with_csc_at_density_auto_and_one_barrier():
    defaults = {f: train.FLAGS[f].default for f in ("compression", "density", "algorithm", "overlap")}
    assert defaults == {"compression": "fp16", "density": "auto", "algorithm": "auto", "overlap": "false"}
    gfar = factory.build_gradient_flow(defaults["compression"], density=defaults["density"],
                                       algorithm=defaults["algorithm"], overlap=defaults["overlap"])
    assert gfar.compression.name == "fp16" and gfar.sparsity.density == "auto"
    assert gfar.sparsity.get_config() == gf_tf.ChunkSparsity().get_config()   # build_gradient_flow's warm-up: 0
    assert gfar.algorithm == "auto" and gfar.overlap is False


@pytest.mark.parametrize("compression, algorithm, overlap, expected", [
    ("auto", "auto", "auto", ("auto", "auto", "auto")),
    ("fp16", "ring", "true", ("fp16", "ring", True)),
    ("bf16", "recursive_doubling", "false", ("bf16", "recursive_doubling", False)),
    ("auto", "recursive_doubling", "true", ("auto", "recursive_doubling", True)),
    # float32 packs: TF's own all-reduce unless --algorithm or --overlap asks for GradientFlow's
    ("none", "recursive_doubling", "false", (None, "recursive_doubling", False)),
    ("none", "auto", "auto", (None, "auto", "auto")),
])
def test_the_planner_flags_become_the_arguments_of_the_same_name(compression, algorithm, overlap, expected):
    gfar = factory.build_gradient_flow(compression, density=1.0, algorithm=algorithm, overlap=overlap)
    assert isinstance(gfar, gf_tf.GradientFlowAllReduce) and gfar.sparsity is None
    got_compression = gfar.compression if gfar.compression == "auto" else gfar.compression.name
    assert (got_compression, gfar.algorithm, gfar.overlap) == expected
    assert gfar.overlap is expected[2]   # True / False themselves, as the API takes them
    want = gf_tf.GradientFlowAllReduce(compression=expected[0], bytes_per_pack=4 << 20,
                                       algorithm=expected[1], overlap=expected[2])
    assert repr(gfar) == repr(want)


def test_compression_none_at_density_1_is_still_tensorflows_own_all_reduce():
    assert factory.build_gradient_flow("none", density=1.0) is None
    assert factory.build_gradient_flow("none", density=1.0, algorithm="auto", overlap="false") is None


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithm": "rign"}, "unknown --algorithm 'rign'; valid values: auto, ring, recursive_doubling"),
    ({"overlap": "yes"}, "unknown --overlap 'yes'; valid values: auto, true, false"),
    ({"overlap": True}, "unknown --overlap True; valid values: auto, true, false"),   # the flag's text only
    ({"compression": "int8"}, "unknown --compression 'int8'; valid values: fp16, bf16, none, auto"),
])
def test_the_factory_rejects_a_bad_planner_flag_value_naming_the_valid_ones(kwargs, message):
    with pytest.raises(ValueError) as error:
        factory.build_gradient_flow(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("flag, value", [("algorithm", "rign"), ("overlap", "yes"), ("compression", "int8")])
def test_the_flag_parser_rejects_a_bad_value(flag, value):
    with pytest.raises(flags.IllegalFlagValueError, match=f"flag --{flag}={value}: value should be one of"):
        train.FLAGS[flag].parse(value)


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "rign"], "flag --algorithm=rign: value should be one of <auto|ring|recursive_doubling>"),
    (["--overlap=yes"], "flag --overlap=yes: value should be one of <auto|true|false>"),
    (["--compression", "int8"], "flag --compression=int8: value should be one of <fp16|bf16|none|auto>"),
])
def test_a_bad_value_exits_2_with_one_line_before_tensorflow_is_imported(argv, message):
    code = ("import sys\n"
            f"sys.argv = ['models.train', *{argv!r}]\n"
            "from models import train\n"
            "try:\n"
            "    train.run()\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, 'tensorflow' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert run.stdout.strip() == "exit 2 False", run.stdout + run.stderr
    assert run.stderr.strip() == f"models.train: error: {message}", run.stderr


# --- the 16-bit baseline: TensorFlow's own all-reduce of float16 gradients ------------------

def test_float16_all_reduce_sends_only_the_gradients_in_float16_and_trains_like_float32():
    """Two replicas in one process (MirroredStrategy over 2 logical CPUs, logged cross-device ops):
    a float32 run all-reduces the gradients in float32, the Float16AllReduceSGD run the same
    tensors in float16 and nothing else; the weights after 8 steps agree within float16 rounding."""
    code = r"""
import json, numpy as np, tensorflow as tf, keras
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
from models import factory

class Logged(tf.distribute.ReductionToOneDevice):
    def __init__(self):
        super().__init__()
        self.seen = []
    def batch_reduce_implementation(self, reduce_op, pairs, options):
        self.seen += [(v.values[0].dtype.name, list(v.values[0].shape)) for v, _ in pairs]
        return super().batch_reduce_implementation(reduce_op, pairs, options)
    def reduce_implementation(self, reduce_op, value, destinations, options):
        self.seen.append((value.values[0].dtype.name, list(value.values[0].shape)))
        return super().reduce_implementation(reduce_op, value, destinations, options)

def train(dtype):
    keras.utils.set_random_seed(0)
    logged = Logged()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=logged)
    x = np.random.RandomState(0).randn(64, 5).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(2)])
        model.compile(factory.build_optimizer(0.1, 0.9, dtype),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return {"seen": logged.seen, "weights": [w.numpy().tolist() for w in model.trainable_weights],
            "shapes": [list(w.shape) for w in model.trainable_weights],
            "iterations": int(model.optimizer.iterations.numpy()), "type": type(model.optimizer).__name__}

print("RESULT " + json.dumps({d: train(d) for d in ("float32", "float16")}))
"""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT)
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    f32, f16 = result["float32"], result["float16"]
    assert (f32["type"], f16["type"]) == ("SGD", "Float16AllReduceSGD")
    assert f32["iterations"] == f16["iterations"] == 8   # 2 epochs of 64 / 16
    gradients = sorted(map(tuple, f16["shapes"]))
    # Every all-reduce of the step carries one gradient: float32 in the plain run, float16 here.
    assert sorted({(d, tuple(s)) for d, s in f32["seen"]}) == sorted({("float32", s) for s in gradients})
    assert sorted({(d, tuple(s)) for d, s in f16["seen"]}) == sorted({("float16", s) for s in gradients})
    # Logged when the step is traced: the same all-reduces, one per gradient, in both runs.
    assert len(f16["seen"]) == len(f32["seen"]) and len(f16["seen"]) % len(gradients) == 0
    for a, b in zip(f32["weights"], f16["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), atol=2e-3)
    assert any(not np.array_equal(np.array(a), np.array(b)) for a, b in zip(f32["weights"], f16["weights"]))


def test_build_optimizer_takes_the_flags_dtype():
    assert type(factory.build_optimizer(0.1, 0.9)) is keras.optimizers.SGD
    assert isinstance(factory.build_optimizer(0.1, 0.9, "float16"), factory.Float16AllReduceSGD)
    with pytest.raises(ValueError, match="unknown --tf_all_reduce_dtype 'bfloat16'; valid values: float32, float16"):
        factory.build_optimizer(0.1, 0.9, "bfloat16")


def test_bytes_per_pack_auto_is_gradient_flows_default():
    assert train.FLAGS["bytes_per_pack"].parser.parse("auto") == "auto"
    assert train.FLAGS["bytes_per_pack"].parser.parse("1024") == 1024
    with pytest.raises(flags.IllegalFlagValueError, match="a whole number of bytes or 'auto'"):
        train.FLAGS["bytes_per_pack"].parse("4MiB")
    chosen = factory.build_gradient_flow("auto", "auto", 1.0, algorithm="auto", overlap="false")
    default = gf_tf.GradientFlowAllReduce()
    assert (chosen.compression, chosen.bytes_per_pack, chosen.algorithm, chosen.overlap, chosen.sparsity) == \
        (default.compression, default.bytes_per_pack, default.algorithm, default.overlap, default.sparsity)
