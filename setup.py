"""Builds gf_tf, compiling the op library ops/*.cc into gf_tf/_gf_tf_ops.so when it can.

The compile command lives in gf_tf/ops/_build.py (loaded here by path), shared with the build that
gf_tf.ops runs on first import. The library is compiled with g++ against the TensorFlow found
at build time and only loads into that exact version, so the version is written next to it
(gf_tf/_gf_tf_ops.tf_version) and checked at import.

    pip install --no-build-isolation .      # builds against the installed TensorFlow
    pip install .                           # isolated build env without TensorFlow: no library in
                                            # the wheel; gf_tf compiles it on first import against
                                            # the runtime TensorFlow, into ~/.cache/gf_tf/
    python setup.py build_ext --inplace     # rebuild the library in the checkout only

Wheels also carry the sources (gf_tf/_ops_src/), so the first-import build works from any
install. Everything else is in pyproject.toml.
"""

import glob
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "gf_tf._gf_tf_ops"          # -> gf_tf/_gf_tf_ops.so
LIBRARY_BASENAME = LIBRARY.split(".")[-1]
SOURCES = sorted(glob.glob(os.path.join("ops", "*.cc"), root_dir=HERE))
HEADERS = sorted(glob.glob(os.path.join("ops", "*.h"), root_dir=HERE))


def _load_build_module():
    spec = importlib.util.spec_from_file_location("gf_tf_build", os.path.join(HERE, "gf_tf", "ops", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()


def _tensorflow():
    """The build environment's TensorFlow, or None (then the library is built on first import)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return tf


class BuildTfOps(build_ext):
    """Compiles the TensorFlow op library with gf_tf/ops/_build.py (not as a Python extension)."""

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
        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        if tf is None:
            print("gf_tf: no TensorFlow in the build environment, so the op library is not built "
                  "now; gf_tf compiles it on first import against the TensorFlow it runs with "
                  "(or use `pip install --no-build-isolation`)", flush=True)
            self._built = False
            return None
        _build.build(tf, os.path.join(HERE, "ops"), output,
                     os.path.abspath(os.path.join(self.build_temp, "ops")), force=self.force)
        self._built = True
        return None

    def copy_extensions_to_source(self):
        # Editable installs and --inplace copy only the .so; bring its version file along.
        if not getattr(self, "_built", True):
            return
        super().copy_extensions_to_source()
        package_dir = self.get_finalized_command("build_py").get_package_dir("gf_tf")
        built = _build.version_file(os.path.join(self.build_lib, "gf_tf", _build.LIBRARY_FILE))
        self.copy_file(built, _build.version_file(os.path.join(package_dir, _build.LIBRARY_FILE)),
                       level=self.verbose)

    def get_outputs(self):
        return super().get_outputs() if getattr(self, "_built", True) else []


class BuildPyWithSources(build_py):
    """Also copies ops/*.cc and ops/*.h into the package (gf_tf/_ops_src/) for first-import builds."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "gf_tf", _build.SOURCE_PACKAGE_DIR)
        self.mkpath(target)
        for source in SOURCES + HEADERS:
            self.copy_file(os.path.join(HERE, source), os.path.join(target, os.path.basename(source)))


setup(
    ext_modules=[Extension(LIBRARY, sources=SOURCES, depends=HEADERS)],
    cmdclass={"build_ext": BuildTfOps, "build_py": BuildPyWithSources},
)
