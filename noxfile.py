"""The supported matrix, one nox session per cell, each in its own venv (README "Supported versions").

    nox -l                                  # list the cells
    nox                                     # run every cell
    nox -s "tf2.18-keras3" "tf2.21-tf_keras"  # the cells CI runs (.ci/run)

A cell is a TensorFlow minor version and a Keras flavour:
  keras3    tensorflow-cpu X.Y with the Keras 3 pip resolves with it
  keras3.N  tensorflow-cpu X.Y with Keras 3.N (its newest patch release), e.g. tf2.19-keras3.9
  tf_keras  tensorflow-cpu X.Y with tf-keras X.Y (installed --no-deps: tf-keras requires the
            `tensorflow` distribution, which would put a second TensorFlow beside tensorflow-cpu)
            and TF_USE_LEGACY_KERAS=1
Per cell: the op build against the cell's TensorFlow (`python -m gf_tf.ops --force`, into
the cell's own cache), the op tests on that library, the fast tests (`-m "not slow"`; these two
on both cores, `-n 2`), the
2-worker FP16 + CSC fit (tests/test_matrix_fit.py), Keras's multi-step loop under
MirroredStrategy and 2 workers (tests/test_multistep.py), and CELL_SLOW_TESTS: the slow tests
that exercise version-dependent wiring (MirroredStrategy fit, the Keras-free core). gf_tf runs from this checkout (PYTHONPATH),
with GF_TF_OPS_LIBRARY naming the cell's library, so cells never share a build. A keras3.N cell
sets GF_TF_KERAS_UNDER_TEST=3.N, so gf_tf accepts that minor there before
gf_tf/keras/flavour.py's TESTED_KERAS_VERSIONS lists it (it lists the minors whose cells passed). Wheels come from
pip's cache after the first run.

    nox -s asan                             # the op library under AddressSanitizer (README "Memory safety")

The `asan` session is not a cell: TensorFlow 2.21 with Keras 3, the op library built with
-fsanitize=address (.ci/asan_build.py, into the session's venv), then the op tests and a 2-worker
CSC fit with the ASan runtime preloaded. An out-of-bounds access in a kernel fails the run.
"""

import importlib.util

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

REPO = os.path.dirname(os.path.abspath(__file__))
TF_VERSIONS = ("2.18", "2.19", "2.20", "2.21")
FLAVOURS = ("keras3", "tf_keras")
# Each older Keras 3 minor (newest patch release) with the TensorFlow it shipped with (2.18: 3.6,
# 2.19: 3.9), or else the oldest TensorFlow of the range pip installs beside it.
KERAS3_CELLS = (("2.18", "3.6"), ("2.18", "3.7"), ("2.18", "3.8"), ("2.19", "3.9"), ("2.20", "3.10"),
                ("2.20", "3.11"), ("2.21", "3.12"), ("2.21", "3.13"), ("2.21", "3.14"))
CELL_SLOW_TESTS = ("tests/test_cross_device_ops.py", "tests/test_versions.py")
TEST_DEPENDENCIES = ("pytest", "pytest-xdist", "scikit-learn", "tensorboard", "absl-py", "numpy")
OP_TESTS = ("tests/test_ops.py", "tests/test_ops_build.py")
ASAN_MULTIWORKER_TEST = ("tests/test_sparsity_multiworker.py::"
                         "test_fit_with_csc_identical_weights_and_chunk_sized_collectives")


def _install(session, tf_version: str, flavour: str, keras_minor: str = None) -> dict:
    """Installs the cell's TensorFlow and Keras; returns the environment the cell runs in.

    keras_minor pins Keras 3 to that minor; without it pip resolves Keras 3 with TensorFlow.
    """
    keras = (f"keras=={keras_minor}.*",) if keras_minor else ()
    session.install(f"tensorflow-cpu=={tf_version}.*", *keras, *TEST_DEPENDENCIES)
    env = {"PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2",
           "GF_TF_CACHE_DIR": os.path.join(session.virtualenv.location, "gf_tf_cache"),
           "TF_USE_LEGACY_KERAS": "1" if flavour == "tf_keras" else "0"}
    if keras_minor:
        env["GF_TF_KERAS_UNDER_TEST"] = keras_minor   # accepted here before TESTED_KERAS_VERSIONS lists it
    if flavour == "tf_keras":
        session.install("--no-deps", f"tf-keras=={tf_version}.*")
    session.run("python", "-c", "import tensorflow as tf, gf_tf.keras.flavour as k; "
                "print('cell: TensorFlow', tf.__version__, k.flavour(), k.keras_module().__version__); "
                "k.check_keras_version()", env=env)
    return env


def _cell(session, tf_version: str, flavour: str, keras_minor: str = None) -> None:
    env = _install(session, tf_version, flavour, keras_minor)
    output = session.run("python", "-m", "gf_tf.ops", "--force", env=env, silent=True)
    env["GF_TF_OPS_LIBRARY"] = output.strip().splitlines()[-1]
    session.log(f"op library: {env['GF_TF_OPS_LIBRARY']}")
    pytest = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider")
    session.run(*pytest, "-n", "2", "-m", "not slow", *OP_TESTS, env=env)
    session.run(*pytest, "-n", "2", "-m", "not slow", *(f"--ignore={t}" for t in OP_TESTS), env=env)
    session.run(*pytest, "tests/test_matrix_fit.py", "tests/test_multistep.py", env=env)
    session.run(*pytest, "-m", "slow", *CELL_SLOW_TESTS, env=env)


def _register(tf_version: str, flavour: str, keras_minor: str = None) -> None:
    def cell(session):
        _cell(session, tf_version, flavour, keras_minor)
    keras = "tf-keras" if flavour == "tf_keras" else f"Keras {keras_minor or 3}"
    cell.__doc__ = f"TensorFlow {tf_version} with {keras}"
    name = f"tf{tf_version}-keras{keras_minor}" if keras_minor else f"tf{tf_version}-{flavour}"
    nox.session(name=name, reuse_venv=True)(cell)


for _tf in TF_VERSIONS:
    for _flavour in FLAVOURS:
        _register(_tf, _flavour)
for _tf, _keras in KERAS3_CELLS:
    _register(_tf, "keras3", _keras)


def _asan_build_module():
    spec = importlib.util.spec_from_file_location("asan_build", os.path.join(REPO, ".ci", "asan_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@nox.session(name="asan", reuse_venv=True)
def asan(session):
    """The op library under AddressSanitizer: op tests and a 2-worker CSC fit."""
    env = _install(session, TF_VERSIONS[-1], "keras3")
    asan_build = _asan_build_module()
    output = session.run("python", asan_build.__file__,
                         os.path.join(session.virtualenv.location, "asan"), env=env, silent=True)
    env["GF_TF_OPS_LIBRARY"] = output.strip().splitlines()[-1]
    env.update(asan_build.runtime_env())
    session.log(f"op library: {env['GF_TF_OPS_LIBRARY']}; " +
                " ".join(f"{k}={env[k]}" for k in ("LD_PRELOAD", "ASAN_OPTIONS")))
    pytest = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider")
    session.run(*pytest, "tests/test_ops.py", env=env)
    session.run(*pytest, ASAN_MULTIWORKER_TEST, env=env)
