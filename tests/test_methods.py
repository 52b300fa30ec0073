"""benchmarks' one method table (benchmarks/workers/methods.py): a method added as one entry
from outside reaches the trainer's flags, the workers' GradientFlowAllReduce, the entry points'
method lists and the byte model. No network, no worker processes."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from benchmarks.workers import gradients


@pytest.fixture
def csc_5():
    """A made-up method added from here: CSC at density 0.05, removed again after the test."""
    from benchmarks.workers import methods
    yield methods.register(methods.Method("csc_5", "GradientFlow CSC 5%", csc={"density": 0.05}))
    methods.unregister("csc_5")


def test_a_method_added_as_one_entry_reaches_the_trainer_the_workers_the_tables_and_the_bytes(csc_5, capsys):
    import copy
    import gf_tf
    from benchmarks import allreduce, convergence
    from benchmarks.workers import methods
    from models import train
    flag_values = copy.deepcopy(train.FLAGS)
    flag_values(["models.train", *methods.trainer_flags("csc_5")])   # models.train's own absl flags
    assert (flag_values.density, flag_values.compression, flag_values.bytes_per_pack, flag_values.algorithm,
            flag_values.overlap, flag_values.selection, flag_values.reducer) == \
        ("0.05", "fp16", 4 * 2 ** 20, "ring", "false", "per_pack", "default")
    gf = gf_tf.GradientFlowAllReduce(**methods.gradient_flow_kwargs("csc_5"))
    assert gf.sparsity.density == 0.05 and gf.sparsity.warmup_steps == 0 and gf.compression.name == "fp16"
    assert methods.LABELS["csc_5"] == "GradientFlow CSC 5%" and "csc_5" in methods.METHODS
    assert "csc_5" not in methods.PRESET_METHODS + methods.CONVERGENCE_METHODS   # runs when named
    assert methods.parse("tf_fp32,csc_5") == ["tf_fp32", "csc_5"]
    assert allreduce.main(["--dry-run", "--methods", "csc_5", "--sets", "tiny", "--workers", "2",
                           "--rates", "100"]) == 0   # allreduce's --methods take it
    # convergence: its dry run takes it, its table lists it in the table's order.
    assert convergence.main(["--dry-run", "--tasks", "mnist1d", "--methods", "csc_5,tf_fp32", "--seeds", "0",
                             "--workers", "2", "--links", "none"]) == 0
    assert "x methods ['tf_fp32', 'csc_5'] x" in capsys.readouterr().out
    # Its bytes: the shared model, between CSC 1% and CSC 10% on ResNet-20's gradients.
    shapes = gradients.GRADIENT_SETS["resnet20"]
    payload, collectives = methods.traffic("csc_5", shapes)
    assert collectives == 2 and methods.payload_bytes("csc_1", shapes) < payload < methods.payload_bytes("csc_10", shapes)
    assert convergence.payload_bytes_per_step("mnist1d", "csc_5") == methods.payload_bytes(
        "csc_5", convergence.TASKS["mnist1d"].shapes)
    assert allreduce.estimate_iter_seconds("csc_5", "resnet20", 2, 100.0) == pytest.approx(
        payload * 8 / (100e6 * 0.95) + 1.9e-8 * gradients.num_elements(shapes) * 2 + 0.05)
