"""Documented attribute paths exist, and bad settings name the fix."""

import os
import subprocess
import sys

import pytest

import gf_tf


def test_documented_submodules_are_attributes_of_a_fresh_gf_tf():
    code = ("import gf_tf; assert callable(gf_tf.worker.exit_together); "
            "assert callable(gf_tf.keras.install); assert gf_tf.launch.main; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_an_unknown_compression_lists_auto_among_the_choices():
    with pytest.raises(ValueError, match=r"compression must be \"auto\" or one of \[None, 'fp16', 'bf16'"):
        gf_tf.GradientFlowAllReduce(compression="fp61")


def test_a_number_as_sparsity_names_chunk_sparsity():
    with pytest.raises(ValueError, match=r"gf_tf\.ChunkSparsity\(density=0\.01\)"):
        gf_tf.GradientFlowAllReduce(sparsity=0.01)


@pytest.mark.parametrize("kwargs, match", [
    ({"algorithm": "tree"}, r"algorithm must be \"auto\" or one of \['ring', 'recursive_doubling'"),
    ({"bytes_per_pack": -1}, r"bytes_per_pack must be \"auto\" or an integer number of bytes >= 0"),
    ({"overlap": "yes"}, r"overlap must be \"auto\", True or False"),
    ({"reducer": object()}, r"reducer must be a gf_tf\.reducers\.Reducer"),
])
def test_bad_settings_name_the_setting_and_its_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gf_tf.GradientFlowAllReduce(**kwargs)


def test_a_missing_explicit_op_library_names_its_variable_not_a_compiler():
    code = "import warnings; warnings.simplefilter('always'); from gf_tf import ops; print(ops.library_status())"
    env = dict(os.environ, GF_TF_OPS_LIBRARY="/nonexistent/lib.so")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    fix = out.stderr.split("To get the compiled ops:")[1]
    assert fix.lstrip().startswith("$GF_TF_OPS_LIBRARY names /nonexistent/lib.so: point it at a "
                                   "library built for this TensorFlow"), out.stderr[-2000:]
