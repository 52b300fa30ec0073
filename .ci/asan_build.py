"""Builds gf_tf's op library with AddressSanitizer: `python .ci/asan_build.py OUT_DIR`.

Same sources, TensorFlow flags and sidecar as gf_tf/ops/_build.py (loaded by path, as setup.py
does: no -march flag, AVX2/F16C per function), with `-O3` replaced by ASAN_FLAGS. Writes
OUT_DIR/_gf_tf_ops.so (never into gf_tf's cache) and prints `export` lines for the run-time
environment (`runtime_env`), then the library's path as the last line. README "Memory
safety (ASan)" and `nox -s asan` (noxfile.py) use it.
"""

import importlib.util
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
# The only suppression: leak checking. At exit, LeakSanitizer reports TensorFlow's and
# Python's never-freed globals (nothing of gf_tf's); every stack passes through Python
# frames, so no suppression pattern could tell ours apart. The kernels own no heap memory
# outliving Compute (TensorFlow allocates their outputs).
ASAN_OPTIONS = "detect_leaks=0"
# Preloaded: the ASan runtime (Python is not linked with it) and libstdc++, which must be
# loaded before the runtime starts, or its __cxa_throw interceptor finds no real
# __cxa_throw and the first C++ exception in TensorFlow aborts with "CHECK failed:
# asan_interceptors.cpp ... real___cxa_throw". Not a suppression: every check stays on.
PRELOAD = ("libasan.so", "libstdc++.so")


def runtime_env(cxx=None):
    """LD_PRELOAD and ASAN_OPTIONS for a process that loads the ASan library."""
    cxx = cxx or os.environ.get("CXX", "g++")
    paths = [subprocess.run([cxx, f"-print-file-name={name}"], check=True, capture_output=True,
                            text=True).stdout.strip() for name in PRELOAD]
    return {"LD_PRELOAD": " ".join(paths), "ASAN_OPTIONS": ASAN_OPTIONS}


def _load_build_module():
    spec = importlib.util.spec_from_file_location("gf_tf_build", os.path.join(REPO, "gf_tf", "ops", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _AsanSysconfig:
    """tf.sysconfig with the sanitizer's flags added (compile and link)."""

    def __init__(self, tf):
        self._tf = tf

    def get_compile_flags(self):
        return list(self._tf.sysconfig.get_compile_flags()) + ASAN_FLAGS

    def get_link_flags(self):
        return ["-fsanitize=address"] + list(self._tf.sysconfig.get_link_flags())


class _AsanTensorFlow:
    """What _build.build reads from the tensorflow module, with _AsanSysconfig."""

    def __init__(self, tf):
        self.__version__ = tf.__version__
        self.sysconfig = _AsanSysconfig(tf)


def main(argv):
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = os.path.abspath(argv[0])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    build = _load_build_module()
    build.EXTRA_FLAGS = [f for f in build.EXTRA_FLAGS if not f.startswith("-O")]
    output = os.path.join(out_dir, build.LIBRARY_FILE)
    build.build(_AsanTensorFlow(tf), os.path.join(REPO, "ops"), output,
                os.path.join(out_dir, "obj"), force=True, log=lambda line: print(line, file=sys.stderr))
    for key, value in runtime_env().items():
        print(f"export {key}={shlex.quote(value)}")
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
