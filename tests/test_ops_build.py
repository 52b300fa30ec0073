"""Properties of the built op library (the one gf_tf.ops loads): portable code, recorded TF version."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

import gf_tf
from gf_tf import ops
from gf_tf.ops import _build, _library


def test_the_compiled_library_is_loaded():
    """README's test command builds the library; if it did not load, the compiled-path tests
    would only skip. GF_TF_ALLOW_COMPOSITE=1 allows a run of the composite path alone."""
    if os.environ.get("GF_TF_ALLOW_COMPOSITE") == "1":
        pytest.skip("GF_TF_ALLOW_COMPOSITE=1")
    assert _library.load() is not None, (
        f"{ops.library_status()}; build it with `pip install -e .` in the checkout "
        f"(or set GF_TF_ALLOW_COMPOSITE=1 to test the composite ops alone)")


@pytest.fixture(scope="module")
def library():
    if _library.load() is None:
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
    assert _build.built_for(library) == tf.__version__
    src_dir = _build.source_dir(os.path.dirname(gf_tf.__file__))
    if _build.built_from(library) is not None and src_dir is not None:
        assert _build.built_from(library) == _build.source_hash(src_dir), "a stale library loaded"


_BUILD_IN_CACHE = """
import os, sys
import tensorflow as tf
import gf_tf
from gf_tf.ops import _build
src = _build.source_dir(os.path.dirname(gf_tf.__file__))
print("PATH", _build.build_in_cache(tf, src, lambda line: print("ANNOUNCE", line, flush=True)))
"""

_LOAD_AND_PACK = """
import numpy as np, tensorflow as tf
from gf_tf import ops
from gf_tf.ops import _build
print(ops.library_status())
x = np.random.default_rng(1).normal(size=1009).astype(np.float32)
got = ops.compiled.pack([tf.constant(x)], tf.float16, 0.5).numpy()
assert np.array_equal(got, (x.astype(np.float64) * 0.5).astype(np.float16)), "pack differs from NumPy"
print("PACK OK")
"""


@pytest.mark.slow
def test_two_processes_importing_at_once_build_the_cache_once(tmp_path):
    """Workers of one job import gf_tf together: one compiles, the other waits for its library."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, GF_TF_CACHE_DIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=repo)
    env.pop(ops.LIBRARY_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_IN_CACHE], env=env, cwd=repo, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    announced = [line for out in outputs for line in out.splitlines() if line.startswith("ANNOUNCE")]
    assert len(announced) == 1 and f"TensorFlow {tf.__version__}" in announced[0], outputs
    paths = {line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1, outputs
    (path,) = paths
    assert path.startswith(str(tmp_path / tf.__version__)) and _build.built_for(path) == tf.__version__
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(os.path.dirname(path)),
                                                    os.path.basename(os.path.dirname(path)) + ".lock"])
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_PACK], env=dict(env, GF_TF_OPS_LIBRARY=path),
                          cwd=repo, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0 and f"compiled ({path}" in done.stdout and "PACK OK" in done.stdout, done.stdout


def test_a_library_built_from_other_sources_is_stale(tmp_path):
    """An editable checkout's old build (same TensorFlow, older ops/) is not loaded: its ops
    would be missing or differ. The sidecar's source hash tells; Bazel's sidecar has none."""
    src_dir = _build.source_dir(os.path.dirname(gf_tf.__file__))
    library = tmp_path / "_gf_tf_ops.so"
    library.write_bytes(b"never loaded: the checks come first")
    sidecar = tmp_path / "_gf_tf_ops.tf_version"
    sidecar.write_text(f"{tf.__version__}\nsources 000000000000\n")
    assert "built from other sources" in _library.mismatch(str(library), src_dir)
    sidecar.write_text(f"{tf.__version__}\nsources {_build.source_hash(src_dir)}\n")
    assert _library.mismatch(str(library), src_dir) is None
    sidecar.write_text(f"{tf.__version__}\n")
    assert _library.mismatch(str(library), src_dir) is None
    sidecar.write_text("2.0.0\n")
    assert "built against TensorFlow 2.0.0" in _library.mismatch(str(library), src_dir)
