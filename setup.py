"""Builds gf_tf, compiling the op library ops/*.cc into gf_tf/_gf_tf_ops.so.

The library is compiled with g++ against the TensorFlow found at build time
(tf.sysconfig flags, used as given) and only loads into that exact version, so
the TensorFlow version is written next to it (gf_tf/_gf_tf_ops.tf_version) and
checked by gf_tf/ops.py at import. Everything else is in pyproject.toml.

    pip install .                           # isolated build env with tensorflow-cpu==2.21.0
    pip install --no-build-isolation -e .   # uses the installed TensorFlow (fast, ~20 s)
    python setup.py build_ext --inplace     # rebuild the library in the checkout only

AVX2/F16C code is enabled per function (target attributes) and chosen at run
time, so no -march/-mf16c flag is passed and the library runs on any x86-64.
"""

import concurrent.futures
import glob
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LIBRARY = "gf_tf._gf_tf_ops"          # -> gf_tf/_gf_tf_ops.so
LIBRARY_BASENAME = LIBRARY.split(".")[-1]
VERSION_FILE = "_gf_tf_ops.tf_version"
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join("ops", "*.cc"), root_dir=HERE))
HEADERS = sorted(glob.glob(os.path.join("ops", "*.h"), root_dir=HERE))
EXTRA_FLAGS = ["-O3", "-fPIC", "-Wall", "-Wno-deprecated-declarations",
               "-Wno-sign-compare", "-Wno-interference-size"]


def _tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise RuntimeError("building gf_tf's op library needs TensorFlow installed in the build "
                           "environment (pyproject.toml's build requirements pin it)") from e
    return tf


class BuildTfOps(build_ext):
    """Compiles the TensorFlow op library with g++ (not as a Python extension)."""

    def get_ext_filename(self, fullname):
        # A plain .so, not a Python extension: no ".cpython-3XX-..." suffix.
        filename = super().get_ext_filename(fullname)
        if fullname.split(".")[-1] == LIBRARY_BASENAME:
            filename = os.path.join(os.path.dirname(filename), LIBRARY_BASENAME + ".so")
        return filename

    def build_extension(self, ext):
        if ext.name != LIBRARY:
            return super().build_extension(ext)
        tf = _tensorflow()
        cxx = os.environ.get("CXX", "g++")
        compile_flags = tf.sysconfig.get_compile_flags() + EXTRA_FLAGS
        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        obj_dir = os.path.abspath(os.path.join(self.build_temp, "ops"))
        os.makedirs(obj_dir, exist_ok=True)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        newest_header = max((os.path.getmtime(os.path.join(HERE, h)) for h in ext.depends),
                            default=0)

        def compile_one(source):
            source = os.path.join(HERE, source)
            obj = os.path.join(obj_dir, os.path.basename(source)[:-3] + ".o")
            if (not self.force and os.path.exists(obj)
                    and os.path.getmtime(obj) > max(os.path.getmtime(source), newest_header)):
                return obj
            self._run([cxx, "-c", source, "-o", obj] + compile_flags)
            return obj

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, ext.sources))
        self._run([cxx, "-shared", "-o", output] + objects + tf.sysconfig.get_link_flags())
        with open(os.path.join(os.path.dirname(output), VERSION_FILE), "w") as f:
            f.write(tf.__version__ + "\n")
        return None

    def copy_extensions_to_source(self):
        # Editable installs and --inplace copy only the .so; bring its version file along.
        super().copy_extensions_to_source()
        package_dir = self.get_finalized_command("build_py").get_package_dir("gf_tf")
        built = os.path.join(self.build_lib, "gf_tf", VERSION_FILE)
        self.copy_file(built, os.path.join(package_dir, VERSION_FILE), level=self.verbose)

    def _run(self, command):
        print(" ".join(shlex.quote(c) for c in command), flush=True)
        subprocess.run(command, check=True, cwd=HERE)


setup(
    ext_modules=[Extension(LIBRARY, sources=SOURCES, depends=HEADERS)],
    cmdclass={"build_ext": BuildTfOps},
)
