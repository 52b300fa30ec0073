"""The op library built by Bazel and the one built by `pip install .` load and agree bit for bit.

Two libraries registering the same op names cannot be loaded into one process, so each runs in its
own subprocess (this file, run as a script): `gf_tf.ops` loads the library named by
GF_TF_OPS_LIBRARY, or its default (pip-built) one when that is unset. Each subprocess runs every op
on the same fixed-seed inputs (eagerly, inside `tf.function`, and through the kernels' scalar path
where they have one) and reports the raw bytes of every result, the `_gf_tf_ops` shared objects
mapped into the process and, per op, which op types of its traced graph come from that library.
The test asserts that each process used the compiled ops of the intended library and that both
sets of results are bitwise equal.

Where the Bazel library is: $GF_TF_BAZEL_LIBRARY (set by .ci/run from .ci/bazel_build.sh), else
bazel-bin/_gf_tf_ops.so. Without one the test skips, unless GF_TF_REQUIRE_BAZEL=1 (CI), where a
missing library is a failure.
"""

import functools
import importlib.util
import os
import pathlib
import pickle
import subprocess
import sys
import types

import pytest

# slow: builds the op library with Bazel and loads it in child processes.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_SECONDS = 300
SIMD_OPS = ["pack", "unpack", "accumulate", "gather_chunks", "scatter_chunks", "abs_max"]
LOWRANK_OPS = ["lowrank_project", "lowrank_project_back", "lowrank_reconstruct"]
PUBLIC_OPS = SIMD_OPS + LOWRANK_OPS
REQUIRE_BAZEL = os.environ.get("GF_TF_REQUIRE_BAZEL") == "1"
BUILD_HINT = ("build it with `.ci/bazel_build.sh $(which python)` (prints its path for "
              "GF_TF_BAZEL_LIBRARY) or `bazel build --repo_env=TF_PYTHON=$(which python) //:_gf_tf_ops.so`")


# ---------------------------------------------------------------------------
# Subprocess side: run every op on fixed inputs and report what happened.
# ---------------------------------------------------------------------------

def _inputs(np, tf):
    rng = np.random.default_rng(20190219)
    special = np.array([65504.0, 65520.0, -7e4, 6e-8, 1e-9, 1e-40, 3.4e38, -3.4e38,
                        np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)
    big = rng.standard_normal(1009).astype(np.float32) * 100.0
    big[:special.size] = special
    float32_tensors = [
        tf.constant(rng.standard_normal(7).astype(np.float32)),
        tf.constant(big),
        tf.constant(np.zeros([2, 0], np.float32)),
        tf.constant(rng.uniform(-1, 1, [1]).astype(np.float32)),
        tf.constant((rng.standard_normal([3, 5]) * 1e-5).astype(np.float32)),
    ]
    mixed_tensors = float32_tensors[:3] + [
        tf.constant(rng.standard_normal([4, 3]).astype(np.float16)),
        tf.constant(rng.standard_normal([2, 2, 2]) * 1e3),  # float64
    ]
    n = sum(int(t.shape.num_elements()) for t in float32_tensors)
    residual = tf.constant(rng.standard_normal(n).astype(np.float32))
    velocity = tf.constant(rng.standard_normal(n).astype(np.float32))
    return float32_tensors, mixed_tensors, residual, velocity


def _bind(fn, *tail, **kwargs):
    """fn(*tensors, *tail, **kwargs) as a function of the tensors only (tf.function traces its arguments)."""
    return lambda *tensors: fn(*tensors, *tail, **kwargs)


def _run_all_ops(np, tf, ops, wrap):
    """Runs every op through `wrap` (identity or tf.function); returns {name: tf result}."""
    float32_tensors, mixed_tensors, residual, velocity = _inputs(np, tf)
    results = {}
    for label, tensors in [("f32", float32_tensors), ("mixed", mixed_tensors)]:
        shapes = [t.shape for t in tensors]
        dtypes = [t.dtype for t in tensors]
        results[f"abs_max_{label}"] = wrap("abs_max", _bind(ops.abs_max))(tensors)
        per_tensor = tf.constant(2.0 ** np.arange(-12, -12 + 5 * len(tensors), 5), tf.float32)
        for wire, scale in [(tf.float16, 0.5), (tf.bfloat16, 1.0), (tf.float32, 0.25),
                            (tf.float16, per_tensor)]:
            key = f"{label}_{wire.name}" + ("_per_tensor" if scale is per_tensor else "")
            packed = wrap("pack", _bind(ops.pack, wire, scale))(tensors)
            results[f"pack_{key}"] = packed
            unpacked = wrap("unpack", _bind(ops.unpack, shapes, dtypes,
                                            1.0 / per_tensor if scale is per_tensor else 2.0))(packed)
            for i, part in enumerate(unpacked):
                results[f"unpack_{key}_{i}"] = part

    shapes = [t.shape for t in float32_tensors]
    dtypes = [t.dtype for t in float32_tensors]
    n = int(residual.shape[0])
    for chunk_size in [100, 1, n + 5]:
        chunks = -(-n // chunk_size)
        indices = tf.constant(sorted({0, chunks // 3, chunks - 1}), tf.int32)
        for momentum_label, momentum in [("plain", None), ("momentum", 0.9)]:
            key = f"c{chunk_size}_{momentum_label}"
            if momentum is None:
                acc, norms, new_velocity = wrap(
                    "accumulate", _bind(ops.accumulate, chunk_size, velocity=None, momentum=0.0)
                )(residual, float32_tensors)
            else:
                acc, norms, new_velocity = wrap(
                    "accumulate", _bind(ops.accumulate, chunk_size, velocity=velocity, momentum=momentum)
                )(residual, float32_tensors)
                results[f"accumulate_{key}_velocity"] = new_velocity
            results[f"accumulate_{key}_acc"] = acc
            results[f"accumulate_{key}_norms"] = norms
            per_chunk = tf.constant([2.0 ** -10, 3.0, 2.0 ** 20][:int(indices.shape[0])], tf.float32)
            for wire, scale in [(tf.float16, 0.5), (tf.bfloat16, 1.0), (tf.float16, per_chunk)]:
                wkey = f"{key}_{wire.name}" + ("_per_chunk" if scale is per_chunk else "")
                selected, left, left_velocity = wrap(
                    "gather_chunks",
                    _bind(ops.gather_chunks, chunk_size, wire, scale, velocity=new_velocity),
                )(acc, indices)
                results[f"gather_{wkey}_selected"] = selected
                results[f"gather_{wkey}_residual"] = left
                if left_velocity is not None:
                    results[f"gather_{wkey}_velocity"] = left_velocity
                parts = wrap(
                    "scatter_chunks", _bind(ops.scatter_chunks, chunk_size, shapes, dtypes,
                                            1.0 / per_chunk if scale is per_chunk else 2.0)
                )(selected, indices)
                for i, part in enumerate(parts):
                    results[f"scatter_{wkey}_{i}"] = part

    rng = np.random.default_rng(1902)
    for n, m, r in [(33, 17, 2), (1, 1, 1), (130, 70, 4)]:
        for dtype in [tf.float32, tf.float16]:
            key = f"{n}x{m}x{r}_{dtype.name}"
            grad = tf.cast(tf.constant(rng.standard_normal([n, m]) * 300.0), dtype)
            residual = tf.constant(rng.standard_normal([n, m]).astype(np.float32))
            q, b = (tf.constant(rng.standard_normal([m, r]).astype(np.float32)) for _ in range(2))
            matrix, p, bound = wrap("lowrank_project", ops.lowrank_project)(grad, residual, q)
            back = wrap("lowrank_project_back", ops.lowrank_project_back)(matrix, p)
            out, left = wrap("lowrank_reconstruct", _bind(ops.lowrank_reconstruct, dtype))(
                matrix, p, b, p, back)
            results.update({f"lowrank_{key}_{name}": value for name, value in [
                ("matrix", matrix), ("p", p), ("bound", bound), ("back", back), ("out", out),
                ("residual", left)]})
    return results


def _mapped_op_libraries():
    """Real paths of the `_gf_tf_ops*` shared objects mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
            if os.path.basename(path).startswith("_gf_tf_ops"):
                paths.add(os.path.realpath(path))
    return sorted(paths)


def _child_main(out_path):
    import numpy as np
    import tensorflow as tf

    from gf_tf import ops

    graph_op_types = {}  # public function -> op types in its traced graphs

    def wrap(name, fn):
        if wrap.mode == "eager":
            return fn
        traced = tf.function(fn)

        def call(*args):
            concrete = traced.get_concrete_function(*args)
            types = {op.type for op in concrete.graph.get_operations()}
            graph_op_types.setdefault(name, set()).update(types)
            return concrete(*args)
        return call

    # The compiled kernels' portable scalar path (the public functions take the AVX2/F16C one here).
    scalar_ops = types.SimpleNamespace(**{
        name: functools.partial(getattr(ops.compiled, name), simd=False) for name in SIMD_OPS},
        **{name: getattr(ops.compiled, name) for name in LOWRANK_OPS})
    report = {"results": {}, "gf_tf_file": ops.__file__}
    for mode, implementation in [("eager", ops), ("function", ops), ("scalar", scalar_ops)]:
        wrap.mode = "function" if mode == "function" else "eager"
        for key, value in _run_all_ops(np, tf, implementation, wrap).items():
            array = value.numpy()
            report["results"][f"{mode}/{key}"] = (value.dtype.name, array.shape, array.tobytes())
    report["mapped_libraries"] = _mapped_op_libraries()
    # Loading an already loaded library again registers nothing; its Python module has one
    # attribute per op type it defines (GfPack, ...), among names that are never op types.
    library_op_types = set()
    for path in report["mapped_libraries"]:
        library_op_types.update(dir(tf.load_op_library(path)))
    report["compiled_op_types"] = {k: sorted(v & library_op_types) for k, v in graph_op_types.items()}
    with open(out_path, "wb") as f:
        pickle.dump(report, f)


# ---------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------

def _unavailable(reason):
    if REQUIRE_BAZEL:
        pytest.fail(reason + " (GF_TF_REQUIRE_BAZEL=1 makes this a failure)")
    pytest.skip(reason)


def _bazel_library():
    configured = os.environ.get("GF_TF_BAZEL_LIBRARY")
    if configured:
        path = pathlib.Path(configured)
        if not path.is_file():
            pytest.fail(f"GF_TF_BAZEL_LIBRARY={configured} is not a file; {BUILD_HINT}")
        return path.resolve()
    default = REPO / "bazel-bin" / "_gf_tf_ops.so"
    if not default.is_file():
        _unavailable(f"no Bazel-built op library (GF_TF_BAZEL_LIBRARY unset, {default} absent); {BUILD_HINT}")
    return default.resolve()


def _run_child(tmp_path, name, library):
    # The child imports the same gf_tf as this process would (installed or checkout), else the checkout's.
    spec = importlib.util.find_spec("gf_tf")
    package_parent = str(pathlib.Path(spec.origin).resolve().parents[1] if spec and spec.origin else REPO)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([package_parent] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("GF_TF_OPS_LIBRARY", None)
    if library is not None:
        env["GF_TF_OPS_LIBRARY"] = str(library)
    out = tmp_path / f"{name}.pickle"
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    assert proc.returncode == 0, (
        f"{name} subprocess failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    with open(out, "rb") as f:
        return pickle.load(f)


def _assert_compiled_ops_used(report, name):
    missing = [op for op in PUBLIC_OPS if not report["compiled_op_types"].get(op)]
    assert not missing, (
        f"{name}: the traced graphs of {missing} contain no op of the loaded library "
        f"{report['mapped_libraries']}, so the compiled path was not used")


def test_bazel_and_pip_libraries_load_and_agree(tmp_path):
    bazel_library = _bazel_library()

    bazel = _run_child(tmp_path, "bazel", bazel_library)
    assert bazel["mapped_libraries"] == [str(bazel_library)], (
        f"with GF_TF_OPS_LIBRARY={bazel_library} the process mapped {bazel['mapped_libraries']}")
    _assert_compiled_ops_used(bazel, "Bazel library")

    pip = _run_child(tmp_path, "pip", None)
    if not pip["mapped_libraries"]:
        _unavailable(f"{pip['gf_tf_file']} loaded no compiled op library by default; build it with "
                     "`pip install .` (or `pip install -e .`)")
    assert len(pip["mapped_libraries"]) == 1 and pip["mapped_libraries"] != bazel["mapped_libraries"], (
        f"the default (pip-built) library should be one file other than the Bazel one; mapped: "
        f"{pip['mapped_libraries']}")
    _assert_compiled_ops_used(pip, "pip-built library")
    assert pip["compiled_op_types"] == bazel["compiled_op_types"]

    assert sorted(pip["results"]) == sorted(bazel["results"])
    differing = [key for key in sorted(bazel["results"]) if bazel["results"][key] != pip["results"][key]]
    assert not differing, (
        f"{len(differing)} of {len(bazel['results'])} results differ between {bazel_library} and "
        f"{pip['mapped_libraries'][0]} (dtype, shape or bytes), e.g. {differing[:8]}")
    # The comparison must have covered real data, not only empty tensors.
    assert sum(len(raw) for _, _, raw in bazel["results"].values()) > 100_000


if __name__ == "__main__":
    _child_main(sys.argv[1])
