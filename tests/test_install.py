"""Installing gf_tf as users do leaves their TensorFlow alone and gives a library for *that* TensorFlow.

One fresh venv holds tensorflow-cpu 2.19 (a supported TF that is not the newest). Installing the
project into it, first with pip's default build isolation, then with --no-build-isolation, must
keep TensorFlow and Keras at the versions the user had, and `gf_tf.ops.library_status()` must
report the compiled library built for TF 2.19: compiled on first import into the per-TF cache
(isolated build: no TF in the build environment) or at build time into the package.
Wheels come from pip's cache after the first run; the slow part is the two compiles.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

# slow: installs the project into fresh venvs.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
USER_TF = "2.19"
PROJECT_FILES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md")


def _run(args, **kwargs):
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout[-6000:]}"
    return done.stdout


def _versions(python):
    out = _run([python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"])
    return {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
            for line in out.splitlines() if "==" in line}


def _library_status(python, env):
    code = ("import gf_tf.ops as o, gf_tf.ops._build as b, tensorflow as tf; "
            "s = o.library_status(); print(tf.__version__); print(s); print(b.built_for(o.library_path()))")
    lines = _run([python, "-c", code], env=env, cwd="/").strip().splitlines()
    return lines[-3], lines[-2], lines[-1]


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    """A venv holding tensorflow-cpu 2.19 (and the Keras pip resolves with it), as a user's would."""
    root = tmp_path_factory.mktemp("user")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", f"tensorflow-cpu=={USER_TF}.*", "setuptools>=68", "wheel"])
    project = root / "project"       # a copy of the sources: the build must not touch the checkout
    project.mkdir()
    for name in PROJECT_FILES:
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "ops", project / "ops", ignore=shutil.ignore_patterns("bazel"))
    shutil.copytree(REPO / "gf_tf", project / "gf_tf",
                    ignore=shutil.ignore_patterns("*.so", "*.tf_version", "__pycache__", "_ops_src"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", GF_TF_CACHE_DIR=str(root / "cache"))
    env.pop("GF_TF_OPS_LIBRARY", None)
    env.pop("PYTHONPATH", None)
    return python, project, env, _versions(python), root / "cache"


def test_install_keeps_the_users_tensorflow_and_builds_for_it_on_first_import(user_venv):
    python, project, env, before, cache = user_venv
    assert before["tensorflow-cpu"].startswith(USER_TF + ".")
    _run([python, "-m", "pip", "install", str(project)], env=env)
    after = _versions(python)
    assert after["tensorflow-cpu"] == before["tensorflow-cpu"]
    assert after["keras"] == before["keras"]
    assert "tensorflow" not in after, "installing gf_tf pulled a second TensorFlow distribution"
    tf_version, status, built = _library_status(python, env)
    assert tf_version == before["tensorflow-cpu"]
    assert status.startswith(f"compiled ({cache}/{tf_version}-"), status
    assert built == tf_version


def test_no_build_isolation_builds_into_the_package_for_the_installed_tensorflow(user_venv):
    python, project, env, before, cache = user_venv
    _run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--force-reinstall",
          str(project)], env=env)
    assert _versions(python)["tensorflow-cpu"] == before["tensorflow-cpu"]
    env = dict(env, GF_TF_CACHE_DIR=str(cache.parent / "unused-cache"))
    tf_version, status, built = _library_status(python, env)
    assert status.startswith("compiled (") and "site-packages/gf_tf/_gf_tf_ops.so" in status, status
    assert built == tf_version == before["tensorflow-cpu"]
    assert not (cache.parent / "unused-cache").exists()


def test_import_without_tensorflow_names_the_extra(tmp_path):
    venv = tmp_path / "bare"
    _run([sys.executable, "-m", "venv", str(venv)])
    done = subprocess.run([str(venv / "bin" / "python"), "-c", "import gf_tf"], cwd=str(REPO),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode != 0
    assert "ImportError: gf_tf needs TensorFlow 2.18-2.21" in done.stdout
    assert "gf_tf[cpu]" in done.stdout


def test_the_docker_images_install_line_trains_the_main_job(tmp_path):
    """No image can be built here (no Docker daemon), so examples/Dockerfile's `RUN pip install`
    line runs in a fresh venv, on a copy of the sources as `COPY . .` gives them, and then the
    image's command trains on 2 local workers (tfjob.yaml's operator sets TF_CONFIG; gf-tf-run
    does here). Only --no-cache-dir is dropped, so the wheels come from pip's cache."""
    dockerfile = (REPO / "examples" / "Dockerfile").read_text()
    install = next(line for line in dockerfile.splitlines() if line.startswith("RUN pip install"))
    args = [a for a in install.split()[3:] if a != "--no-cache-dir"]
    command = next(line for line in dockerfile.splitlines() if line.startswith("CMD "))
    assert args == ['".[cpu,models]"'] and command == 'CMD ["python", "-m", "models.train"]', \
        "the Dockerfile changed: update this test's reading of it"
    project = tmp_path / "gf_tf"
    project.mkdir()
    for name in PROJECT_FILES:
        shutil.copy(REPO / name, project / name)
    for tree in ("ops", "gf_tf", "models"):
        shutil.copytree(REPO / tree, project / tree, ignore=shutil.ignore_patterns(
            "bazel", "*.so", "*.tf_version", "__pycache__", "_ops_src"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GF_TF_OPS_LIBRARY", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", GF_TF_CACHE_DIR=str(tmp_path / "cache"),
               PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    _run([str(venv / "bin" / "pip"), "install", "-q", ".[cpu,models]"], env=env, cwd=project)
    out = _run([str(venv / "bin" / "gf-tf-run"), "-n", "2", "--", "python", "-m", "models.train"],
               env=env, cwd=project, timeout=900)
    accuracies = [float(a) for a in re.findall(r"\] test accuracy: ([0-9.]+)", out)]
    assert len(accuracies) == 2 and min(accuracies) > 0.9, out[-4000:]
