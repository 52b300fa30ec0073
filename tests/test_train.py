"""models.factory (flag values -> objects) and `python -m models.train` on a real 2-worker cluster."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import gf_tf
from gf_tf import launch
from gf_tf.csc import AUTO_LADDER
from models import factory

# slow: most tests run `python -m models.train` on worker processes; the flag tests stay with them.
pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- factory -----------------------------------------------------------------------------

@pytest.mark.parametrize("call, flag, valid", [
    (lambda: factory.build_model("resnet18", (32, 32, 3), 10), "model", "digits_cnn, resnet20"),
    (lambda: factory.load_dataset("imagenet21k"), "dataset", "digits, mnist, cifar10"),
    (lambda: factory.build_strategy("tpu"), "strategy", "multi_worker_mirrored, mirrored, one_device"),
    (lambda: factory.build_gradient_flow("int8"), "compression", "fp16, bf16, none"),
    (lambda: factory.set_precision("float16"), "mixed_precision", "none, mixed_float16, mixed_bfloat16"),
])
def test_unknown_flag_values_list_the_valid_ones(call, flag, valid):
    with pytest.raises(ValueError) as error:
        call()
    assert f"unknown --{flag}" in str(error.value) and valid in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    # The CSC flags are checked by gf_tf.ChunkSparsity; its messages reach the user with the flag's "--".
    ({"density": 0.0}, "--density must be a fraction in (0, 1] or \"auto\", got 0.0"),
    ({"density": 1.5}, "--density must be a fraction in (0, 1] or \"auto\", got 1.5"),
    ({"density": "fast"}, "--density must be a fraction in (0, 1] or \"auto\", got 'fast'"),
    ({"density": 0.1, "chunk_size": 0}, "--chunk_size must be an int >= 1"),
    ({"chunk_size": 0}, "--chunk_size must be an int >= 1"),
    ({"bytes_per_pack": -1}, "--bytes_per_pack must be >= 0"),
    ({"warmup_steps": -1}, "--warmup_steps must be an int >= 0"),
    ({"density": 0.1, "momentum": 1.0}, "--momentum must be in [0, 1)"),
    ({"selection": "whole"}, "--selection must be one of ('per_pack', 'global', 'ahead')"),
])
def test_out_of_range_communication_flags_name_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        factory.build_gradient_flow(**kwargs)
    assert message in str(error.value)


def test_gradient_flow_follows_the_flags():
    assert factory.build_gradient_flow("none", density=1.0) is None
    dense = factory.build_gradient_flow("bf16", bytes_per_pack=1 << 20)
    assert isinstance(dense, gf_tf.GradientFlowAllReduce)
    assert dense.compression.name == "bf16" and dense.bytes_per_pack == 1 << 20 and dense.sparsity is None
    sparse = factory.build_gradient_flow("fp16", density=0.05, chunk_size=128, warmup_steps=7, momentum=0.9)
    assert (sparse.sparsity.density, sparse.sparsity.chunk_size, sparse.sparsity.warmup_steps,
            sparse.sparsity.momentum, sparse.sparsity.selection) == (0.05, 128, 7, 0.9, "per_pack")
    whole = factory.build_gradient_flow("fp16", density=0.01, selection="global")
    assert whole.sparsity.selection == "global"
    auto = factory.build_gradient_flow("fp16", density="auto", warmup_steps=3, momentum=0.9)
    assert auto.sparsity.density == "auto" and auto.sparsity.warmup_steps == 3
    assert [factory.parse_density(t) for t in ("auto", "AUTO", "0.5", "1")] == ["auto", "auto", 0.5, 1.0]
    assert factory.uses_csc("auto") and factory.uses_csc(0.5) and not factory.uses_csc(1.0)


@pytest.mark.parametrize("momentum_correction, density, expected", [
    (False, 0.01, (0.0, 0.9)),     # the default: CSC is plain error feedback, the optimizer has the momentum
    (False, "auto", (0.0, 0.9)),
    (True, 0.01, (0.9, 0.0)),      # DGC's momentum correction inside ChunkSparsity, plain SGD
    (True, "auto", (0.9, 0.0)),
    (True, 1.0, (0.0, 0.9)),       # no CSC: nothing to correct
])
def test_momentum_goes_to_the_optimizer_unless_csc_corrects_it(momentum_correction, density, expected):
    assert factory.split_momentum(0.9, momentum_correction, density) == expected


def test_reducer_lowrank_flag_gives_the_low_rank_reducer():
    lowrank = factory.build_gradient_flow("none", reducer="lowrank", rank=4)
    assert isinstance(lowrank.reducer, gf_tf.reducers.LowRank) and lowrank.reducer.rank == 4
    assert lowrank.compression.name is None and lowrank.sparsity is None
    assert not lowrank.reducer.alternate
    acp = factory.build_gradient_flow("fp16", reducer="lowrank", rank=2, lowrank_alternate=True)
    assert acp.reducer.alternate and acp.reducer.rank == 2
    assert not isinstance(factory.build_gradient_flow("fp16").reducer, gf_tf.reducers.LowRank)


@pytest.mark.parametrize("kwargs, message", [
    ({"reducer": "lowrank", "rank": 0}, "--rank must be an integer >= 1, got 0"),
    ({"reducer": "lowrank", "density": 0.1}, "--reducer lowrank cannot be combined with CSC"),
    ({"reducer": "powersgd"}, "unknown --reducer 'powersgd'; valid values: default, lowrank"),
])
def test_reducer_flag_errors_name_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        factory.build_gradient_flow(**kwargs)
    assert message in str(error.value)


def test_one_device_refuses_gradient_flow():
    with pytest.raises(ValueError, match="one_device has no all-reduce"):
        factory.build_strategy("one_device", gradient_flow=factory.build_gradient_flow("fp16"))


def test_every_model_has_a_synthetic_input_shape():
    for name in factory.MODELS:
        source = factory.load_dataset("synthetic", model=name)
        assert source.input_shape == factory.default_input_shape(name)


@pytest.mark.parametrize("dtype, width", [("float32", 4), ("float16", 2)])
def test_tensorflow_s_bytes_count_an_embedding_s_rows_not_its_table(dtype, width):
    """topic_attention with a 50 x 8 table over 5 tokens, 4 examples a replica: the embedding's
    gradient is 20 rows of 8 (and their indices, int32 or int64), every other weight dense."""
    from models import networks, traffic
    model = networks.topic_attention(input_shape=(5, 1), num_classes=3, vocab=50, dim=8)
    table = 50 * 8
    others = sum(int(tf.size(w)) for w in model.trainable_weights) - table
    got = traffic.tf_bytes_per_step(model, 4, dtype)
    index = got["sent_bytes_per_step"] - width * others - 20 * width * 8
    assert index in (20 * 4, 20 * 8)   # int32 or int64 indices
    assert got["dense_bytes_per_step"] == 4 * others + 20 * 4 * 8 + index


def test_bad_flag_value_exits_2_with_the_valid_values():
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", "--model", "vgg16"], env=env,
                         capture_output=True, timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 2
    assert "unknown --model 'vgg16'; valid values: digits_cnn" in run.stderr.decode()


@pytest.mark.parametrize("flag, value, message", [
    ("--epochs", "0", "--epochs must be >= 1, got 0"),
    ("--batch_size", "0", "--batch_size must be >= 1, got 0"),
    ("--seed", "-1", "--seed must be >= 0, got -1"),
    ("--collective_timeout", "0", "--collective_timeout must be > 0 seconds"),
    ("--momentum", "1", "--momentum must be in [0, 1), got 1.0"),
])
def test_out_of_range_numbers_exit_2_with_one_line_naming_the_flag(flag, value, message):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", flag, value], env=env,
                         capture_output=True, timeout=60, cwd=REPO_ROOT)
    assert run.returncode == 2
    assert message in run.stderr.decode()
    assert "Traceback" not in run.stderr.decode()


def test_reducer_lowrank_trains_at_the_trainer_s_other_defaults():
    """--reducer lowrank alone: the default CSC density gives way (the low-rank reducer replaces CSC)."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", "--reducer", "lowrank", "--dataset",
                          "synthetic", "--epochs", "1", "--steps_per_epoch", "3"], env=env,
                         capture_output=True, timeout=240, cwd=REPO_ROOT)
    text = run.stdout.decode() + run.stderr.decode()
    assert run.returncode == 0, text[-3000:]
    assert "gradient all-reduce: GradientFlowAllReduce" in text and "density 1," in text, text[-3000:]


def test_a_float16_tf_all_reduce_with_gradient_flow_exits_2_naming_the_flags():
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", "--tf_all_reduce_dtype", "float16"], env=env,
                         capture_output=True, timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 2, run.stderr.decode()[-2000:]
    assert ("models.train: error: --tf_all_reduce_dtype float16 is TensorFlow's own all-reduce: give it with "
            "--compression none --density 1") in run.stderr.decode()
    assert "Traceback" not in run.stderr.decode()


def test_mnist1d_trains_its_own_model_and_records_a_curve_per_epoch(tmp_path):
    """Two replicas in one process, TF's float16 all-reduce, 2 epochs of 3 steps on mnist1d."""
    pytest.importorskip("mnist1d", reason="pip install '.[tasks]'")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", "--dataset", "mnist1d", "--compression", "none",
                          "--density", "1", "--tf_all_reduce_dtype", "float16", "--epochs", "2",
                          "--steps_per_epoch", "3", "--curve", "--model_dir", str(tmp_path)],
                         env=env, capture_output=True, timeout=300, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    params = 7_785   # models.networks.mnist1d_cnn's trainable parameters
    assert results["model"] == "mnist1d_cnn" and results["source"] == "TF float16 all-reduce"
    assert (results["sent_bytes_per_step"], results["dense_bytes_per_step"]) == (2.0 * params, 4.0 * params)
    curve = results["curve"]
    assert [p["epoch"] for p in curve] == [1, 2]
    assert [p["bytes_sent"] for p in curve] == [3 * 2.0 * params, 6 * 2.0 * params]
    assert 0 < curve[0]["seconds"] < curve[1]["seconds"]
    assert abs(curve[-1]["test_accuracy"] - results["test_accuracy"]) < 1e-9


# --- a real 2-worker run -----------------------------------------------------------------

def test_two_worker_training_run_learns_and_reports_bytes(tmp_path):
    """gf-tf-run -n 2 -- python -m models.train, one short epoch of FP16 + CSC after 2 dense steps."""
    model_dir = tmp_path / "model"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    out = io.BytesIO()
    code = launch.run_workers(2, [
        sys.executable, "-m", "models.train", "--epochs", "1", "--steps_per_epoch", "16",
        "--batch_size", "32", "--learning_rate", "0.02", "--warmup_steps", "5", "--density", "0.05",
        "--collective_timeout", "60", f"--model_dir={model_dir}"], env=env, out=out)
    text = out.getvalue().decode()
    assert code == 0, text[-3000:]

    accuracy = {int(w): float(a) for w, a in re.findall(r"\[worker (\d)\] test accuracy: ([\d.]+)", text)}
    assert sorted(accuracy) == [0, 1]
    assert accuracy[0] == accuracy[1], "workers disagree: weights were not kept in sync"
    assert accuracy[0] > 0.4, text[-3000:]  # 16 steps; chance is 0.1
    assert re.search(r"\[worker 0\] throughput: [\d.]+ images/s", text)

    results = json.loads((model_dir / "results.json").read_text())
    assert abs(results["test_accuracy"] - accuracy[0]) < 1e-4
    model = factory.build_model("digits_cnn", (8, 8, 1), 10)
    float32_bytes = 4 * sum(int(tf.size(w)) for w in model.trainable_weights)
    assert results["dense_bytes_per_step"] == float32_bytes
    # 5 dense FP16 steps (half the bytes) then 11 sparse ones: far below float32 dense.
    assert results["steps"] == 16
    assert results["sent_bytes_per_step"] < 0.3 * float32_bytes
    assert results["last_epoch_sent_bytes_per_step"] == results["sent_bytes_per_step"]

    # Only the chief leaves artefacts; worker 1's temporary directory is gone.
    assert sorted(os.listdir(model_dir)) == ["checkpoint.weights.h5", "final.weights.h5", "logs",
                                             "results.json"]


def test_without_tf_config_it_trains_two_replicas_in_one_process_through_gradient_flow():
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "models.train", "--epochs", "1", "--steps_per_epoch", "4",
                          "--warmup_steps", "1", "--density", "0.05"],
                         env=env, capture_output=True, timeout=300, cwd=REPO_ROOT)
    text = run.stdout.decode()
    assert run.returncode == 0, (text + run.stderr.decode())[-3000:]
    assert "TF_CONFIG is not set: training 2 replicas in this process" in text
    assert "2 replicas; chief: True; gradient all-reduce: GradientFlowAllReduce" in text
    sent, dense = map(lambda s: float(s.replace(",", "")), re.search(
        r"bytes sent per step per replica: ([\d,]+) .* vs ([\d,]+) for float32", text).groups())
    assert 0 < sent < 0.5 * dense  # 1 dense FP16 step, 3 sparse ones


def test_density_auto_flag_trains_and_reports_the_chosen_density(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    model_dir = tmp_path / "model"
    run = subprocess.run([sys.executable, "-m", "models.train", "--epochs", "1", "--steps_per_epoch", "4",
                          "--warmup_steps", "1", "--density", "auto", f"--model_dir={model_dir}"],
                         env=env, capture_output=True, timeout=300, cwd=REPO_ROOT)
    text = run.stdout.decode()
    assert run.returncode == 0, (text + run.stderr.decode())[-3000:]
    assert "density auto" in text
    results = json.loads((model_dir / "results.json").read_text())
    assert results["flags"]["density"] == "auto" and results["steps"] == 4
    # 1 dense step, then 3 steps at rungs of gf_tf.csc.AUTO_LADDER (whichever the clock chose).
    assert 1 + 3 * 0.001 - 1e-9 <= 4 * results["density"] <= 1 + 3 * AUTO_LADDER[0] + 1e-9
    assert results["sent_bytes_per_step"] < results["dense_bytes_per_step"]


def test_planner_flags_reach_gradient_flow_and_the_results(tmp_path):
    """--compression auto --algorithm recursive_doubling --overlap auto: the library's planner,
    in one process of 2 replicas; the start line and results.json carry the values."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    model_dir = tmp_path / "model"
    run = subprocess.run([sys.executable, "-m", "models.train", "--epochs", "1", "--steps_per_epoch", "4",
                          "--compression", "auto", "--algorithm", "recursive_doubling", "--overlap", "auto",
                          "--density", "1", f"--model_dir={model_dir}"],
                         env=env, capture_output=True, timeout=300, cwd=REPO_ROOT)
    text = run.stdout.decode()
    assert run.returncode == 0, (text + run.stderr.decode())[-3000:]
    assert "gradient all-reduce: GradientFlowAllReduce (compression auto, algorithm recursive_doubling, " \
           "overlap auto, density 1," in text, text
    results = json.loads((model_dir / "results.json").read_text())
    assert {f: results["flags"][f] for f in ("compression", "algorithm", "overlap")} == \
        {"compression": "auto", "algorithm": "recursive_doubling", "overlap": "auto"}
    assert results["steps"] == 4 and results["source"] == "gf_tf CommStats"


def test_two_workers_without_gradient_flow_back_up_from_the_chief_only(tmp_path):
    """TF's own float32 all-reduce (no GradientFlow) with --model_dir on 2 workers: only the
    chief writes the BackupAndRestore files. (Both once wrote latest.weights.h5 and one died
    with h5py's 'unable to lock file'.)"""
    model_dir = tmp_path / "model"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    out = io.BytesIO()
    code = launch.run_workers(2, [
        sys.executable, "-m", "models.train", "--epochs", "2", "--steps_per_epoch", "4",
        "--batch_size", "32", "--compression", "none", "--density", "1",
        "--collective_timeout", "60", f"--model_dir={model_dir}"], env=env, out=out)
    text = out.getvalue().decode()
    assert code == 0, text[-3000:]
    assert "gradient all-reduce: TF float32" in text
    assert len(re.findall(r"\[worker \d\] test accuracy", text)) == 2
