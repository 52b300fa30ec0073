"""Builds gf_tf's op library with AddressSanitizer: `python .ci/asan_build.py OUT_DIR`.

Same sources, TensorFlow flags and sidecar as gf_tf/_build.py (loaded by path, as setup.py
does: no -march flag, AVX2/F16C per function), with `-O3` replaced by ASAN_FLAGS. Writes
OUT_DIR/_gf_tf_ops.so (never into gf_tf's cache) and prints its path as the last line. Run
the tests with it as README "Memory safety (ASan)" says: GF_TF_OPS_LIBRARY=<that path>,
LD_PRELOAD=$(g++ -print-file-name=libasan.so) and ASAN_OPTIONS=ASAN_OPTIONS below.
"""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
# TensorFlow and Python are not instrumented: leaks at exit are theirs (detect_leaks=0);
# nothing else is suppressed.
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:print_summary=1"


def _load_build_module():
    spec = importlib.util.spec_from_file_location("gf_tf_build", os.path.join(REPO, "gf_tf", "_build.py"))
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
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
