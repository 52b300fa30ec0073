"""Properties of the built op library (the one gf_tf.ops loads): portable code, recorded TF version."""

import os
import re
import shutil
import subprocess

import pytest
import tensorflow as tf

from gf_tf import ops


def test_the_compiled_library_is_loaded():
    """README's test command builds the library; if it did not load, the compiled-path tests
    would only skip. GF_TF_ALLOW_COMPOSITE=1 allows a run of the composite path alone."""
    if os.environ.get("GF_TF_ALLOW_COMPOSITE") == "1":
        pytest.skip("GF_TF_ALLOW_COMPOSITE=1")
    assert ops._lib() is not None, (
        f"{ops.library_status()}; build it with `pip install -e .` in the checkout "
        f"(or set GF_TF_ALLOW_COMPOSITE=1 to test the composite ops alone)")


@pytest.fixture(scope="module")
def library():
    if ops._lib() is None:
        pytest.skip(f"compiled ops unavailable: {ops.library_status()}")
    return ops.library_path()


def test_vector_instructions_only_in_runtime_dispatched_functions(library):
    """AVX2/F16C code sits only in the *Simd functions chosen at run time (no global -mavx/-mf16c),
    so the library runs on x86-64 CPUs without those extensions."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library],
                             check=True, capture_output=True, text=True).stdout
    function, offenders, simd_functions = "", set(), set()
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        instruction = re.match(r"^\s+[0-9a-f]+:\s+(\S+)", line)
        if instruction and instruction.group(1).startswith("v"):  # VEX/EVEX-encoded: AVX and later
            (simd_functions if "Simd" in function else offenders).add(function)
    assert not offenders, f"AVX instructions outside the dispatched functions: {sorted(offenders)}"
    assert any("F32ToHalfSimd" in f for f in simd_functions), "the F16C pack kernel was not built"


def test_library_records_the_tensorflow_version_it_was_built_against(library):
    version_file = os.path.splitext(library)[0] + ops.VERSION_FILE_SUFFIX
    if not os.path.exists(version_file):
        pytest.skip(f"{version_file} not written by this build")
    with open(version_file) as f:
        assert f.read().strip() == tf.__version__
