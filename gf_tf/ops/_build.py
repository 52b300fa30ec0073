"""Compiles gf_tf's op library (ops/*.cc) against a TensorFlow: the one compile command of gf_tf.

Two callers, one command:
- setup.py loads this file by path (it must not import the gf_tf package) and builds
  gf_tf/_gf_tf_ops.so at wheel time when TensorFlow is importable in the build environment
  (`pip install --no-build-isolation .`, `python setup.py build_ext --inplace`);
- gf_tf.ops calls `build_in_cache` on first use when no library for the running TensorFlow is
  at hand and a C++ compiler is present (default build isolation: the build environment has no
  TensorFlow), as torch.utils.cpp_extension and Triton build theirs.

The library links against libtensorflow_framework.so.2 and loads only into the exact
TensorFlow version it was compiled against; that version is written next to it
(`<library>.tf_version`: the version, then `sources <hash of ops/*.cc, *.h>`). Flags:
tf.sysconfig's compile and link flags as given, plus EXTRA_FLAGS. AVX2/F16C code is enabled per function and chosen at run time, so no -march flag
is passed and the library runs on any x86-64.

This module imports only the standard library; TensorFlow is passed in.
"""

import concurrent.futures
import contextlib
import glob
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional, Sequence

LIBRARY_FILE = "_gf_tf_ops.so"
VERSION_SUFFIX = ".tf_version"          # <library minus .so> + this: the TF version it was built for
CACHE_ENV = "GF_TF_CACHE_DIR"           # overrides ~/.cache/gf_tf (or $XDG_CACHE_HOME/gf_tf)
SOURCE_PACKAGE_DIR = "_ops_src"         # where wheels carry ops/*.cc and ops/*.h inside gf_tf/
# The gf_tf package directory (this module sits in gf_tf/ops/): it holds the shipped library
# (LIBRARY_FILE and its sidecar) and the wheel's SOURCE_PACKAGE_DIR.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA_FLAGS = ["-O3", "-fPIC", "-Wall", "-Wno-deprecated-declarations",
               "-Wno-sign-compare", "-Wno-interference-size"]


def compiler() -> str:
    """The C++ compiler command: $CXX, or g++."""
    return os.environ.get("CXX", "g++")


def have_compiler() -> bool:
    """True if `compiler()` is an executable on PATH (or a path to one)."""
    return shutil.which(compiler()) is not None


def version_file(library: str) -> str:
    """The sidecar holding the TensorFlow version `library` was built against."""
    return os.path.splitext(library)[0] + VERSION_SUFFIX


def _sidecar(library: str) -> List[str]:
    try:
        with open(version_file(library)) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def built_for(library: str) -> Optional[str]:
    """The TensorFlow version recorded next to `library`, or None if no sidecar exists."""
    fields = _sidecar(library)
    return fields[0] if fields else None


def built_from(library: str) -> Optional[str]:
    """The source hash (`source_hash`) recorded next to `library`, or None (e.g. a Bazel build)."""
    fields = _sidecar(library)
    return fields[2] if len(fields) >= 3 and fields[1] == "sources" else None


def source_hash(src_dir: str) -> str:
    """First 12 hex digits of a SHA-256 over the names and contents of the .cc and .h files."""
    digest = hashlib.sha256()
    for path in sources(src_dir) + headers(src_dir):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.hexdigest()[:12]


def source_dir(package_dir: str) -> Optional[str]:
    """ops/ sources for the gf_tf package at `package_dir`: shipped inside it, or the checkout's."""
    for candidate in (os.path.join(package_dir, SOURCE_PACKAGE_DIR),
                      os.path.join(os.path.dirname(package_dir), "ops")):
        if glob.glob(os.path.join(candidate, "*.cc")):
            return candidate
    return None


def sources(src_dir: str) -> List[str]:
    """The .cc files of the library (sorted)."""
    return sorted(glob.glob(os.path.join(src_dir, "*.cc")))


def headers(src_dir: str) -> List[str]:
    """The .h files the sources include (sorted)."""
    return sorted(glob.glob(os.path.join(src_dir, "*.h")))


def _run(command: Sequence[str], log: Callable[[str], None]) -> None:
    log(" ".join(shlex.quote(c) for c in command))
    done = subprocess.run(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.stdout.strip():
        log(done.stdout.rstrip())
    if done.returncode != 0:
        raise RuntimeError(f"compiling gf_tf's op library failed (exit code {done.returncode}) "
                           f"running: {' '.join(shlex.quote(c) for c in command)}\n{done.stdout[-4000:]}")


def build(tf, src_dir: str, output: str, obj_dir: str, force: bool = False,
          log: Callable[[str], None] = print) -> str:
    """Compiles src_dir/*.cc against `tf` (the tensorflow module) into `output` + its sidecar.

    Objects go to `obj_dir` and are reused when newer than their source and every header
    (unless `force`). Compiles run in parallel, one per CPU. Returns `output`.
    Raises RuntimeError with the compiler's output if a command fails.
    """
    cxx = compiler()
    compile_flags = list(tf.sysconfig.get_compile_flags()) + EXTRA_FLAGS
    os.makedirs(obj_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    newest_header = max((os.path.getmtime(h) for h in headers(src_dir)), default=0)

    def compile_one(source):
        obj = os.path.join(obj_dir, os.path.basename(source)[:-3] + ".o")
        if (not force and os.path.exists(obj)
                and os.path.getmtime(obj) > max(os.path.getmtime(source), newest_header)):
            return obj
        _run([cxx, "-c", source, "-o", obj] + compile_flags, log)
        return obj

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, sources(src_dir)))
    _run([cxx, "-shared", "-o", output] + objects + list(tf.sysconfig.get_link_flags()), log)
    with open(version_file(output), "w") as f:
        f.write(f"{tf.__version__}\nsources {source_hash(src_dir)}\n")
    return output


# --- the per-TensorFlow-version cache used at first import ---------------------------------

def cache_root() -> str:
    """$GF_TF_CACHE_DIR, else $XDG_CACHE_HOME/gf_tf, else ~/.cache/gf_tf."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gf_tf")


def cache_key(tf, src_dir: str) -> str:
    """`<tf version>-<abi tag>`: TF version, machine, C++ ABI flag and a hash of the sources.

    A new gf_tf (changed sources) or another TensorFlow gets its own directory.
    """
    abi = next((f.split("=")[1] for f in tf.sysconfig.get_compile_flags()
                if f.startswith("-D_GLIBCXX_USE_CXX11_ABI=")), "x")
    return f"{tf.__version__}-{platform.machine()}-cxx11abi{abi}-{source_hash(src_dir)}"


def cached_library(tf, src_dir: str) -> str:
    """Where the cache keeps the library for `tf` built from `src_dir` (may not exist yet)."""
    return os.path.join(cache_root(), cache_key(tf, src_dir), LIBRARY_FILE)


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """An exclusive advisory lock (flock) on `lock_path`, held for the with-block."""
    import fcntl  # pylint: disable=import-outside-toplevel  (POSIX only, like the kernels)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_in_cache(tf, src_dir: str, announce: Callable[[str], None]) -> str:
    """Returns the cached library for `tf`, compiling it first if it is not there.

    Processes importing gf_tf at once (workers of one job) serialise on a lock file: one
    compiles (calling `announce` with one line), the others wait and then load its result.
    The library is built in a temporary directory and renamed into place, so a crash never
    leaves a half-written library behind. Raises RuntimeError (compiler failure) or OSError
    (cache not writable).
    """
    target = cached_library(tf, src_dir)
    final_dir = os.path.dirname(target)
    os.makedirs(cache_root(), exist_ok=True)
    with _exclusive(final_dir + ".lock"):
        if os.path.exists(target) and built_for(target) == tf.__version__:
            return target
        announce(f"gf_tf: compiling the op library for TensorFlow {tf.__version__} into "
                 f"{final_dir} (once per TensorFlow version; 20-90 s)")
        work = tempfile.mkdtemp(prefix=os.path.basename(final_dir) + ".tmp-", dir=cache_root())
        os.chmod(work, 0o755)
        try:
            log_lines = []
            build(tf, src_dir, os.path.join(work, LIBRARY_FILE), os.path.join(work, "obj"),
                  log=log_lines.append)
            shutil.rmtree(os.path.join(work, "obj"))
            if os.path.exists(final_dir):       # a stale or partial entry: replace it
                shutil.rmtree(final_dir)
            os.rename(work, final_dir)
        finally:
            if os.path.exists(work):
                shutil.rmtree(work, ignore_errors=True)
    return target


def announce_to_stderr(line: str) -> None:
    """Prints one line to stderr (what the first-import build says)."""
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] = None) -> int:
    """`python -m gf_tf.ops [--force]` (gf_tf/ops/__main__.py): builds the cached library for the
    running TensorFlow.

    Prints the library's path as the last line (--force: rebuild even if it is cached).
    """
    import argparse  # pylint: disable=import-outside-toplevel
    parser = argparse.ArgumentParser(prog="python -m gf_tf.ops", description=main.__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    src_dir = source_dir(PACKAGE_DIR)
    if src_dir is None:
        print("gf_tf: the op sources (ops/*.cc) are not installed with this gf_tf", file=sys.stderr)
        return 1
    if args.force and os.path.exists(os.path.dirname(cached_library(tf, src_dir))):
        shutil.rmtree(os.path.dirname(cached_library(tf, src_dir)))
    print(build_in_cache(tf, src_dir, announce_to_stderr))
    return 0
