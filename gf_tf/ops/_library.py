"""gf_tf.ops' compiled library: found, version-checked, built if need be, and loaded once.

In order: $GF_TF_OPS_LIBRARY (that library or none); the package's own
`gf_tf/_gf_tf_ops.so` if it was built for the running TensorFlow from these sources; the
per-TensorFlow-version cache, compiled there on first use when a C++ compiler is present
(`gf_tf.ops._build`, which holds the compile command and the cache layout). Without one,
`load()` warns once and the public functions run the composite ops.
"""

import ctypes
import os
import sys
import threading
import warnings
from typing import Optional, Tuple

import tensorflow as tf

from gf_tf.ops import _build

LIBRARY_ENV = "GF_TF_OPS_LIBRARY"
LIBRARY_FILE = _build.LIBRARY_FILE
# Written next to the library (by gf_tf/ops/_build.py or Bazel): the TensorFlow version it was built against.
VERSION_FILE_SUFFIX = _build.VERSION_SUFFIX
BUILD_COMMAND = ("a C++ compiler (g++, or $CXX) on PATH: gf_tf then compiles the library on first "
                 "import into ~/.cache/gf_tf ($GF_TF_CACHE_DIR); or, in a checkout, "
                 "`pip install --no-build-isolation -e .`")
# Modules whose frames a fallback warning skips (gf_tf.ops and its modules), to name the first
# caller outside gf_tf.ops.
_OPS_MODULES = ("gf_tf.ops",)


class _Library:
    module = None          # the tf.load_op_library module, or None
    path = None            # the file it was loaded from
    status = ""            # one line for library_status()
    loaded = False


_library = _Library()
_library_lock = threading.Lock()
# gf_tf/, which holds the shipped library and the wheel's op sources (not this module's gf_tf/ops/).
_PACKAGE_DIR = _build.PACKAGE_DIR


def path() -> str:
    """The loaded library's path, or else the first place the loader looks."""
    return _library.path or os.environ.get(LIBRARY_ENV) or os.path.join(_PACKAGE_DIR, LIBRARY_FILE)


def _fall_back(reason: str) -> None:
    _library.status = f"composite ({reason})"
    frame, stacklevel = sys._getframe(0), 1  # pylint: disable=protected-access
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_OPS_MODULES):
        frame, stacklevel = frame.f_back, stacklevel + 1
    if os.environ.get(LIBRARY_ENV):
        fix = (f"${LIBRARY_ENV} names {os.environ[LIBRARY_ENV]}: point it at a library built for "
               f"this TensorFlow (`python -m gf_tf.ops` builds one and prints its path), or unset "
               f"it to use gf_tf's own build ({BUILD_COMMAND})")
    else:
        fix = BUILD_COMMAND
    warnings.warn(f"gf_tf: {reason}; using the composite TensorFlow ops instead "
                  f"(same results, slower). To get the compiled ops: {fix}.",
                  RuntimeWarning, stacklevel=stacklevel)


def mismatch(library: str, src_dir: Optional[str] = None) -> Optional[str]:
    """Why the library at `library` cannot serve the running TensorFlow, or None if it can.

    With `src_dir`, a library recording another source hash is stale (an older checkout's build).
    """
    if not os.path.exists(library):
        return f"compiled ops library not built ({library} is missing)"
    built = _build.built_for(library)
    if built is not None and built != tf.__version__:
        return (f"compiled ops library {library} was built against TensorFlow {built}, "
                f"but TensorFlow {tf.__version__} is running")
    recorded = _build.built_from(library)
    if src_dir is not None and recorded is not None and recorded != _build.source_hash(src_dir):
        return f"compiled ops library {library} was built from other sources than {src_dir}"
    return None


def _find_or_build() -> Tuple[Optional[str], str]:
    """(path of a library built for the running TF, "") or (None, why there is none).

    Builds one into the cache when needed and possible (compiler and sources present).
    """
    if os.environ.get(LIBRARY_ENV):       # an explicit library: that one or nothing
        explicit = os.environ[LIBRARY_ENV]
        return (None, mismatch(explicit)) if mismatch(explicit) else (explicit, "")
    shipped = os.path.join(_PACKAGE_DIR, LIBRARY_FILE)
    src_dir = _build.source_dir(_PACKAGE_DIR)
    reason = mismatch(shipped, src_dir)
    if reason is None:
        return shipped, ""
    if src_dir is None:
        return None, f"{reason}, and gf_tf's op sources are not installed to build it"
    cached = _build.cached_library(tf, src_dir)
    if mismatch(cached) is None:
        return cached, ""
    if not _build.have_compiler():
        return None, f"{reason}, and no C++ compiler ({_build.compiler()}) is on PATH to build it"
    try:
        return _build.build_in_cache(tf, src_dir, _build.announce_to_stderr), ""
    except (RuntimeError, OSError) as e:
        return None, f"{reason}; building it in {_build.cache_root()} failed: {str(e).splitlines()[0]}"


def _load_library() -> None:
    found, reason = _find_or_build()
    if found is None:
        return _fall_back(reason)
    try:
        module = tf.load_op_library(found)
    except (tf.errors.OpError, OSError) as e:
        first_line = (getattr(e, "message", None) or str(e)).strip().splitlines()[0]
        return _fall_back(f"compiled ops library {found} failed to load ({first_line})")
    simd = bool(ctypes.CDLL(found).gf_tf_cpu_has_simd())
    _library.module, _library.path = module, found
    _library.status = (f"compiled ({found}, "
                       f"{'AVX2+F16C' if simd else 'scalar'} kernels)")


def load():
    """The loaded op module, or None (after one warning saying why)."""
    if not _library.loaded:
        with _library_lock:
            if not _library.loaded:
                _load_library()
                _library.loaded = True
    return _library.module


def status() -> str:
    """One line: 'compiled (<path>, AVX2+F16C kernels)' or 'composite (<why>)'."""
    load()
    return _library.status


def require():
    """The loaded op module; RuntimeError saying why and how to get it if there is none."""
    module = load()
    if module is None:
        raise RuntimeError(f"gf_tf compiled ops are unavailable: {_library.status}. "
                           f"To get them: {BUILD_COMMAND}")
    return module
