"""GradientFlow tensor ops: pack/unpack and the chunk ops of CSC.

Every function here has two implementations with the same contract:
the compiled custom ops of ``ops/`` and an equivalent composite of stock
TensorFlow ops. The library is loaded once, lazily: ``gf_tf/_gf_tf_ops.so`` if
it was built for the running TensorFlow, else the per-TensorFlow-version cache
(``~/.cache/gf_tf/<tf version>-<abi tag>/``), compiled there on first use when a
C++ compiler is present (``gf_tf._build``). The public functions pick one
implementation per call: the compiled kernels when the library loaded, every
input tensor is on the CPU and the call is not being compiled by XLA; the
composite otherwise (no library and no compiler, GPU/TPU tensors,
``tf.function(jit_compile=True)``). ``library_status()`` says which one runs;
``compiled`` and ``composite`` call one explicitly (tests, benchmarks).
``GF_TF_OPS_LIBRARY=<path>`` loads another build of the library (e.g. the
Bazel one) and nothing else.

The scaling ops (pack, unpack, gather_chunks, scatter_chunks) take ``scale``
as a run-time value: a Python float, a float32 scalar tensor (one scale for
everything) or a float32 vector with one scale per tensor (pack, unpack) or
per selected chunk (gather_chunks, scatter_chunks), e.g. power-of-two scales
chosen from the all-reduced ``abs_max`` of each tensor.

Terms: a *pack* (bucket) is the 1-D concatenation of several flattened
tensors; a *chunk* is a run of ``chunk_size`` consecutive pack elements
(the last chunk may be partial), so a pack of ``n`` elements has
``num_chunks(n, chunk_size) = ceil(n / chunk_size)`` chunks.
Source: GradientFlow (arXiv 1902.06855), sections on lazy all-reduce,
mixed-precision communication and coarse-grained sparse communication.
"""

import ctypes
import numbers
import os
import sys
import threading
import types
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from gf_tf import _build, tf_internal

LIBRARY_ENV = "GF_TF_OPS_LIBRARY"
LIBRARY_FILE = _build.LIBRARY_FILE
# Written next to the library (by gf_tf/_build.py or Bazel): the TensorFlow version it was built against.
VERSION_FILE_SUFFIX = _build.VERSION_SUFFIX
BUILD_COMMAND = ("a C++ compiler (g++, or $CXX) on PATH: gf_tf then compiles the library on first "
                 "import into ~/.cache/gf_tf ($GF_TF_CACHE_DIR); or, in a checkout, "
                 "`pip install --no-build-isolation -e .`")

# The dtype sets of the ops (the one place on the Python side; ops/gf_kernels.h
# has the same sets for the op registrations).
GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)  # tensors packed and unpacked
WIRE_DTYPES = (tf.float16, tf.bfloat16, tf.float32)              # buffers on the wire


def _dtype_names(dtypes) -> str:
    names = [d.name for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def num_chunks(num_elements: int, chunk_size: int) -> int:
    """ceil(num_elements / chunk_size); raises ValueError if chunk_size < 1."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 element, got {chunk_size}")
    return -(-num_elements // chunk_size)


def chunk_lengths_total(num_elements: int, chunk_size: int, indices: Sequence[int]) -> int:
    """Number of elements covered by the chunks `indices` (last chunk partial)."""
    last = num_chunks(num_elements, chunk_size) - 1
    tail = num_elements - last * chunk_size
    return sum(tail if i == last else chunk_size for i in indices)


# ---------------------------------------------------------------------------
# The compiled library: found, version-checked and loaded once, on first use.
# ---------------------------------------------------------------------------

class _Library:
    module = None          # the tf.load_op_library module, or None
    path = None            # the file it was loaded from
    status = ""            # one line for library_status()
    loaded = False


_library = _Library()
_library_lock = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """Path of the op library this process loaded, or else the first place it looks.

    In order: $GF_TF_OPS_LIBRARY; the package's own `gf_tf/_gf_tf_ops.so` if it was built
    for the running TensorFlow; the per-TensorFlow-version cache (`gf_tf._build.cache_root()`).
    """
    return _library.path or os.environ.get(LIBRARY_ENV) or os.path.join(_PACKAGE_DIR, LIBRARY_FILE)


def _fall_back(reason: str) -> None:
    _library.status = f"composite ({reason})"
    # Attribute the warning to the first caller outside this module.
    frame, stacklevel = sys._getframe(0), 1  # pylint: disable=protected-access
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(f"gf_tf: {reason}; using the composite TensorFlow ops instead "
                  f"(same results, slower). To get the compiled ops: {BUILD_COMMAND}.",
                  RuntimeWarning, stacklevel=stacklevel)


def _mismatch(path: str, src_dir: Optional[str] = None) -> Optional[str]:
    """Why the library at `path` cannot serve the running TensorFlow, or None if it can.

    With `src_dir`, a library recording another source hash is stale (an older checkout's build).
    """
    if not os.path.exists(path):
        return f"compiled ops library not built ({path} is missing)"
    built = _build.built_for(path)
    if built is not None and built != tf.__version__:
        return (f"compiled ops library {path} was built against TensorFlow {built}, "
                f"but TensorFlow {tf.__version__} is running")
    recorded = _build.built_from(path)
    if src_dir is not None and recorded is not None and recorded != _build.source_hash(src_dir):
        return f"compiled ops library {path} was built from other sources than {src_dir}"
    return None


def _find_or_build() -> Tuple[Optional[str], str]:
    """(path of a library built for the running TF, "") or (None, why there is none).

    Builds one into the cache when needed and possible (compiler and sources present).
    """
    if os.environ.get(LIBRARY_ENV):       # an explicit library: that one or nothing
        path = os.environ[LIBRARY_ENV]
        return (None, _mismatch(path)) if _mismatch(path) else (path, "")
    shipped = os.path.join(_PACKAGE_DIR, LIBRARY_FILE)
    src_dir = _build.source_dir(_PACKAGE_DIR)
    reason = _mismatch(shipped, src_dir)
    if reason is None:
        return shipped, ""
    if src_dir is None:
        return None, f"{reason}, and gf_tf's op sources are not installed to build it"
    cached = _build.cached_library(tf, src_dir)
    if _mismatch(cached) is None:
        return cached, ""
    if not _build.have_compiler():
        return None, f"{reason}, and no C++ compiler ({_build.compiler()}) is on PATH to build it"
    try:
        return _build.build_in_cache(tf, src_dir, _build.announce_to_stderr), ""
    except (RuntimeError, OSError) as e:
        return None, f"{reason}; building it in {_build.cache_root()} failed: {str(e).splitlines()[0]}"


def _load_library() -> None:
    path, reason = _find_or_build()
    if path is None:
        return _fall_back(reason)
    try:
        module = tf.load_op_library(path)
    except (tf.errors.OpError, OSError) as e:
        first_line = (getattr(e, "message", None) or str(e)).strip().splitlines()[0]
        return _fall_back(f"compiled ops library {path} failed to load ({first_line})")
    simd = bool(ctypes.CDLL(path).gf_tf_cpu_has_simd())
    _library.module, _library.path = module, path
    _library.status = (f"compiled ({path}, "
                       f"{'AVX2+F16C' if simd else 'scalar'} kernels)")


def _lib():
    """The loaded op module, or None (after one warning saying why)."""
    if not _library.loaded:
        with _library_lock:
            if not _library.loaded:
                _load_library()
                _library.loaded = True
    return _library.module


def library_status() -> str:
    """One line: 'compiled (<path>, AVX2+F16C kernels)' or 'composite (<why>)'.

    Says what runs for CPU tensors outside XLA; GPU tensors and XLA always use
    the composite ops.
    """
    _lib()
    return _library.status


def _on_cpu(tensors) -> bool:
    for t in tensors:
        device = (getattr(t, "device", "") or "").upper()
        if "GPU" in device or "TPU" in device:
            return False
    return True


def _implementation(tensors):
    if _lib() is not None and _on_cpu(tensors) and not tf_internal.in_xla_context():
        return compiled
    return composite


# ---------------------------------------------------------------------------
# Argument checks shared by both implementations.
# ---------------------------------------------------------------------------

def _floating_tensors(tensors, what: str) -> List[tf.Tensor]:
    out = []
    for i, t in enumerate(tensors):
        t = tf.convert_to_tensor(t)
        if t.dtype not in GRAD_DTYPES:
            raise TypeError(f"{what}: tensors[{i}] has dtype {t.dtype.name}; only "
                            f"{_dtype_names(GRAD_DTYPES)} tensors are accepted")
        out.append(t)
    return out


def _wire(wire_dtype) -> tf.DType:
    wire_dtype = tf.as_dtype(wire_dtype)
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be {_dtype_names(WIRE_DTYPES)}, got {wire_dtype.name}")
    return wire_dtype


def _shapes_and_sizes(shapes, dtypes, what: str):
    shapes = [tf.TensorShape(s) for s in shapes]
    dtypes = [tf.as_dtype(d) for d in dtypes]
    if len(shapes) != len(dtypes):
        raise ValueError(f"{what}: {len(shapes)} shapes but {len(dtypes)} dtypes")
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        if not s.is_fully_defined():
            raise ValueError(f"{what}: shapes[{i}] = {s} is not fully defined")
        if d not in GRAD_DTYPES:
            raise TypeError(f"{what}: dtypes[{i}] = {d.name} is not a floating dtype")
    return shapes, dtypes, [s.num_elements() for s in shapes]


def _check_static_length(t, expected: int, what: str, name: str) -> None:
    n = t.shape[0] if t.shape.rank == 1 else None
    if t.shape.rank not in (None, 1):
        raise ValueError(f"{what}: {name} must be 1-D, got shape {t.shape}")
    if n is not None and n != expected:
        raise ValueError(f"{what}: {name} has {n} elements but {expected} are expected")


def _flat_float32(t, what: str, name: str) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    if t.dtype != tf.float32:
        raise TypeError(f"{what}: {name} must be float32, got {t.dtype.name}")
    if t.shape.rank not in (None, 1):
        raise ValueError(f"{what}: {name} must be 1-D, got shape {t.shape}")
    return t


def _indices(indices) -> tf.Tensor:
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype.name}")
    return indices


# What a vector `scale` holds, per op (the kernels' messages say the same).
PER_TENSOR = "one scale per input tensor"
PER_OUTPUT = "one scale per output tensor"
PER_CHUNK = "one scale per selected chunk, k = len(indices)"


def _scale(scale, count: Optional[int], what: str, items: str):
    """Checks `scale`; returns it as a float (Python number) or a float32 tensor.

    Python numbers are rounded to float32 (the kernels' arithmetic) and stay
    Python floats; anything else becomes a float32 tensor of shape [] or
    [count] (checked here where static, in the kernels / the composite's
    run-time check otherwise). `count` None: not known statically.
    """
    if tf.is_tensor(scale):
        if scale.dtype != tf.float32:
            raise TypeError(f"{what}: scale must be float32, got {scale.dtype.name}; "
                            "cast it with tf.cast(scale, tf.float32)")
    else:
        with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as in the kernels
            if isinstance(scale, numbers.Real):
                return float(np.float32(scale))
            scale = tf.constant(np.asarray(scale, np.float32))
    shape = scale.shape
    if shape.rank in (None, 0) or (shape.rank == 1 and None in (shape[0], count)) or \
            (shape.rank == 1 and shape[0] == count):
        return scale
    got = ",".join("?" if d is None else str(d) for d in shape.as_list())
    expected = "?" if count is None else count
    raise ValueError(f"{what}: scale must have shape [] or [{expected}] ({items}), got [{got}]")


def _scale_tensor(scale) -> tf.Tensor:
    """The `scale` input of a compiled op (see _scale)."""
    return tf.constant(scale, tf.float32) if isinstance(scale, float) else scale


def _static_count(indices) -> Optional[int]:
    return indices.shape[0] if indices.shape.rank == 1 else None


# ---------------------------------------------------------------------------
# Composite reference implementations (stock TF ops only).
# ---------------------------------------------------------------------------

def _round_to_odd_float32(x64):
    """float64 -> float32 rounded toward zero, last bit set if inexact.

    Casting that to float16/bfloat16 (nearest even) equals rounding the float64
    directly; a plain float64->float32->float16 cast can round twice.
    """
    f = tf.cast(x64, tf.float32)
    back = tf.cast(f, tf.float64)
    bits = tf.bitcast(f, tf.int32)
    bits = tf.where(tf.abs(back) > tf.abs(x64), bits - 1, bits)   # toward zero
    inexact = tf.logical_and(tf.not_equal(back, x64), tf.logical_not(tf.math.is_nan(x64)))
    bits = tf.where(inexact, tf.bitwise.bitwise_or(bits, 1), bits)
    return tf.bitcast(bits, tf.float32)


def _times(x, scale):
    """x * scale in x's dtype; scale: a float (1.0: nothing to do) or a float32 tensor."""
    if isinstance(scale, float):
        return x if scale == 1.0 else x * scale
    return x * tf.cast(scale, x.dtype)


def _composite_scale_vector(scale, count, what: str, items: str) -> tf.Tensor:
    """A tensor `scale` (shape [] or [count]) as float32 [count], checked at run time."""
    rank_ok = tf.equal(tf.rank(scale), 0)
    length_ok = tf.logical_and(tf.equal(tf.rank(scale), 1),
                               tf.equal(tf.size(scale, out_type=tf.int64), tf.cast(count, tf.int64)))
    expected = count if isinstance(count, int) else "k"
    check = tf.debugging.Assert(tf.logical_or(rank_ok, length_ok), [
        f"{what}: scale must have shape [] or [{expected}] ({items}); the count and the shape "
        "of scale:", count, tf.shape(scale)])
    with tf.control_dependencies([check]):
        return tf.broadcast_to(tf.reshape(scale, [-1]), tf.reshape(count, [1]))


def _composite_item_scales(scale, count: int, what: str, items: str) -> list:
    """Checks `scale` (see _scale); per item (tensor) i < count, its scale: a float or a
    float32 scalar tensor."""
    scale = _scale(scale, count, what, items)
    if isinstance(scale, float) or scale.shape.rank == 0:
        return [scale] * count
    if scale.shape.rank != 1 or scale.shape[0] is None:
        scale = _composite_scale_vector(scale, count, what, items)
    return tf.unstack(scale, num=count) if count else []


def _composite_to_wire(flat, wire_dtype, scale):
    """wire(flat * scale); scale: float, float32 scalar, or float32 per element."""
    if flat.dtype == tf.float64:
        x = _times(flat, scale)
        return tf.cast(x, tf.float32) if wire_dtype == tf.float32 else \
            tf.cast(_round_to_odd_float32(x), wire_dtype)
    return tf.cast(_times(tf.cast(flat, tf.float32), scale), wire_dtype)


def _composite_pack(tensors, wire_dtype, scale=1.0):
    tensors = _floating_tensors(tensors, "pack")
    wire_dtype = _wire(wire_dtype)
    scales = _composite_item_scales(scale, len(tensors), "pack", PER_TENSOR)
    if not tensors:
        return tf.zeros([0], wire_dtype)
    # Cast each tensor, then concatenate: the cheaper order (the casts read
    # the inputs once; one concat writes the small wire buffer).
    parts = [_composite_to_wire(tf.reshape(t, [-1]), wire_dtype, s)
             for t, s in zip(tensors, scales)]
    return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]


def _composite_from_wire(part, dtype, scale):
    return tf.cast(_times(tf.cast(part, tf.float32), scale), dtype)


def _composite_unpack(buffer, shapes, dtypes, scale=1.0):
    shapes, dtypes, sizes = _shapes_and_sizes(shapes, dtypes, "unpack")
    buffer = tf.convert_to_tensor(buffer)
    _check_static_length(buffer, sum(sizes), "unpack", "the packed buffer")
    scales = _composite_item_scales(scale, len(sizes), "unpack", PER_OUTPUT)
    if not sizes:
        return []
    # Split first (it returns views), then cast each part.
    parts = tf.split(buffer, sizes) if len(sizes) > 1 else [buffer]
    return [tf.reshape(_composite_from_wire(p, d, k), s)
            for p, s, d, k in zip(parts, shapes, dtypes, scales)]


_SIGN_CLEARED = {  # dtype -> (integer dtype of its bits, mask clearing the sign bit)
    tf.float16: (tf.int16, 0x7fff), tf.bfloat16: (tf.int16, 0x7fff),
    tf.float32: (tf.int32, 0x7fffffff), tf.float64: (tf.int64, 0x7fffffffffffffff)}


def _composite_abs_max_one(t) -> tf.Tensor:
    """max |t| as in the kernel: on the bits with the sign cleared, whose integer
    order is the order of magnitudes with NaN above inf. Exact for subnormals,
    which TensorFlow's float max reads as 0 (its kernels run denormals-are-zero)."""
    int_dtype, mask = _SIGN_CLEARED[t.dtype]
    bits = tf.bitwise.bitwise_and(tf.bitcast(tf.reshape(t, [-1]), int_dtype),
                                  tf.constant(mask, int_dtype))
    largest = tf.maximum(tf.reduce_max(bits), tf.zeros([], int_dtype))  # 0 (+0.0) if empty
    return tf.cast(tf.bitcast(largest, t.dtype), tf.float32)


def _composite_abs_max(tensors):
    tensors = _floating_tensors(tensors, "abs_max")
    if not tensors:
        return tf.zeros([0], tf.float32)
    return tf.stack([_composite_abs_max_one(t) for t in tensors])


def _chunk_ids(n, chunk_size):
    return tf.range(n, dtype=tf.int64) // chunk_size


def _composite_accumulate(residual, tensors, chunk_size, velocity, momentum):
    num_chunks(0, chunk_size)  # validates chunk_size
    residual = _flat_float32(residual, "accumulate", "residual")
    grad = _composite_pack(tensors, tf.float32, 1.0)
    if residual.shape[0] is not None:
        _check_static_length(grad, residual.shape[0], "accumulate", "the packed tensors")
    new_velocity = None
    if velocity is not None:
        velocity = _flat_float32(velocity, "accumulate", "velocity")
        new_velocity = momentum * velocity + grad
        grad = new_velocity
    acc = residual + grad
    n = tf.shape(acc, out_type=tf.int64)[0]
    chunks = (n + chunk_size - 1) // chunk_size
    norms = tf.math.unsorted_segment_sum(tf.abs(acc), _chunk_ids(n, chunk_size), chunks)
    return acc, norms, new_velocity


def _composite_check_indices(indices, n, chunk_size, what):
    """Asserts indices are in [0, num_chunks), ascending and unique."""
    indices = tf.cast(indices, tf.int64)
    chunks = (n + chunk_size - 1) // chunk_size
    checks = [
        tf.debugging.assert_non_negative(indices, message=f"{what}: indices must be >= 0"),
        tf.debugging.assert_less(indices, chunks, message=(
            f"{what}: indices out of range: every index must be < num_chunks "
            f"(ceil(n / chunk_size), chunk_size={chunk_size})")),
        tf.debugging.assert_greater(indices[1:], indices[:-1], message=(
            f"{what}: indices must be sorted ascending without duplicates")),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(indices)


def _element_mask(n, chunk_size, indices):
    """bool[n], True inside the chunks `indices` (int64, validated)."""
    chunks = (n + chunk_size - 1) // chunk_size
    chunk_selected = tf.scatter_nd(tf.expand_dims(indices, 1),
                                   tf.ones_like(indices, tf.bool), [chunks])
    return tf.gather(chunk_selected, _chunk_ids(n, chunk_size))


def _composite_chunk_scales(scale, indices, num_selected, chunk_size, what):
    """The scale of each selected element: a float or float32 scalar, else float32 [m].

    Selected chunk j holds elements [j * chunk_size, (j + 1) * chunk_size) of
    the selected buffer (only the last chunk of a pack can be partial).
    """
    if isinstance(scale, float) or scale.shape.rank == 0:
        return scale
    if scale.shape.rank != 1 or scale.shape[0] is None or indices.shape[0] is None:
        scale = _composite_scale_vector(scale, tf.size(indices), what, PER_CHUNK)
    chunk_of_element = tf.range(num_selected, dtype=tf.int64) // chunk_size
    return tf.gather(scale, chunk_of_element)


def _composite_gather_chunks(acc, indices, chunk_size, wire_dtype, scale=1.0, velocity=None):
    num_chunks(0, chunk_size)
    acc = _flat_float32(acc, "gather_chunks", "acc")
    wire_dtype = _wire(wire_dtype)
    indices = _indices(indices)
    scale = _scale(scale, _static_count(indices), "gather_chunks", PER_CHUNK)
    n = tf.shape(acc, out_type=tf.int64)[0]
    checked = _composite_check_indices(indices, n, chunk_size, "gather_chunks")
    mask = _element_mask(n, chunk_size, checked)
    values = tf.boolean_mask(acc, mask)
    scales = _composite_chunk_scales(scale, indices, tf.size(values, out_type=tf.int64),
                                     chunk_size, "gather_chunks")
    selected = _composite_to_wire(values, wire_dtype, scales)
    zeros = tf.zeros_like(acc)
    residual = tf.where(mask, zeros, acc)
    new_velocity = None
    if velocity is not None:
        velocity = _flat_float32(velocity, "gather_chunks", "velocity")
        new_velocity = tf.where(mask, zeros, velocity)
    return selected, residual, new_velocity


def _composite_scatter_chunks(selected, indices, chunk_size, shapes, dtypes, scale=1.0):
    num_chunks(0, chunk_size)
    shapes, dtypes, sizes = _shapes_and_sizes(shapes, dtypes, "scatter_chunks")
    n = sum(sizes)
    selected = tf.convert_to_tensor(selected)
    indices = _indices(indices)
    scale = _scale(scale, _static_count(indices), "scatter_chunks", PER_CHUNK)
    checked = _composite_check_indices(indices, tf.constant(n, tf.int64),
                                       chunk_size, "scatter_chunks")
    mask = _element_mask(n, chunk_size, checked)
    positions = tf.where(mask)
    check = tf.debugging.assert_equal(
        tf.shape(selected, out_type=tf.int64)[0], tf.shape(positions, out_type=tf.int64)[0],
        message="scatter_chunks: selected must have as many elements as the chunks in indices cover")
    with tf.control_dependencies([check]):
        scales = _composite_chunk_scales(scale, indices, tf.shape(positions, out_type=tf.int64)[0],
                                         chunk_size, "scatter_chunks")
        values = _times(tf.cast(selected, tf.float32), scales)
        # An update, not scatter_nd's sum into zeros, which would turn -0.0 into +0.0.
        full = tf.tensor_scatter_nd_update(tf.zeros([n], tf.float32), positions, values)
    return _composite_unpack(full, shapes, dtypes, 1.0)


composite = types.SimpleNamespace(
    pack=_composite_pack, unpack=_composite_unpack, accumulate=_composite_accumulate,
    gather_chunks=_composite_gather_chunks, scatter_chunks=_composite_scatter_chunks,
    abs_max=_composite_abs_max)
composite.__doc__ = "The composite-TF implementation, called explicitly (same arguments as the public functions)."


# ---------------------------------------------------------------------------
# Compiled implementations (the kernels of ops/*.cc). `simd=False` forces
# their portable scalar code (tests); they validate in the kernels.
# ---------------------------------------------------------------------------

def _require_lib():
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"gf_tf compiled ops are unavailable: {_library.status}. "
                           f"To get them: {BUILD_COMMAND}")
    return lib


def _compiled_pack(tensors, wire_dtype, scale=1.0, simd=True):
    lib = _require_lib()
    tensors = _floating_tensors(tensors, "pack")
    wire_dtype = _wire(wire_dtype)
    scale = _scale_tensor(_scale(scale, len(tensors), "pack", PER_TENSOR))
    if not tensors:
        return tf.zeros([0], wire_dtype)
    return lib.gf_pack(tensors, scale, wire_dtype=wire_dtype, simd=simd)


def _compiled_unpack(buffer, shapes, dtypes, scale=1.0, simd=True):
    lib = _require_lib()
    shapes, dtypes, sizes = _shapes_and_sizes(shapes, dtypes, "unpack")
    buffer = tf.convert_to_tensor(buffer)
    _check_static_length(buffer, sum(sizes), "unpack", "the packed buffer")
    scale = _scale_tensor(_scale(scale, len(sizes), "unpack", PER_OUTPUT))
    if not sizes:
        return []
    return lib.gf_unpack(buffer, scale, Tout=dtypes, shapes=shapes, simd=simd)


def _compiled_abs_max(tensors, simd=True):
    lib = _require_lib()
    tensors = _floating_tensors(tensors, "abs_max")
    if not tensors:
        return tf.zeros([0], tf.float32)
    return lib.gf_abs_max(tensors, simd=simd)


def _compiled_accumulate(residual, tensors, chunk_size, velocity, momentum, simd=True):
    lib = _require_lib()
    residual = _flat_float32(residual, "accumulate", "residual")
    tensors = _floating_tensors(tensors, "accumulate")
    velocities = [] if velocity is None else [_flat_float32(velocity, "accumulate", "velocity")]
    acc, norms, new_velocity = lib.gf_accumulate(
        residual, tensors, velocities, chunk_size=int(chunk_size),
        momentum=float(momentum), simd=simd)
    return acc, norms, (new_velocity[0] if new_velocity else None)


def _compiled_gather_chunks(acc, indices, chunk_size, wire_dtype, scale=1.0, velocity=None,
                            simd=True):
    lib = _require_lib()
    acc = _flat_float32(acc, "gather_chunks", "acc")
    indices = _indices(indices)
    scale = _scale_tensor(_scale(scale, _static_count(indices), "gather_chunks", PER_CHUNK))
    velocities = [] if velocity is None else [_flat_float32(velocity, "gather_chunks", "velocity")]
    selected, residual, new_velocity = lib.gf_gather_chunks(
        acc, indices, scale, velocities, chunk_size=int(chunk_size),
        wire_dtype=_wire(wire_dtype), simd=simd)
    return selected, residual, (new_velocity[0] if new_velocity else None)


def _compiled_scatter_chunks(selected, indices, chunk_size, shapes, dtypes, scale=1.0, simd=True):
    lib = _require_lib()
    shapes, dtypes, _ = _shapes_and_sizes(shapes, dtypes, "scatter_chunks")
    indices = _indices(indices)
    scale = _scale_tensor(_scale(scale, _static_count(indices), "scatter_chunks", PER_CHUNK))
    if not shapes:
        return []
    return lib.gf_scatter_chunks(
        tf.convert_to_tensor(selected), indices, scale, chunk_size=int(chunk_size),
        Tout=dtypes, shapes=shapes, simd=simd)


compiled = types.SimpleNamespace(
    pack=_compiled_pack, unpack=_compiled_unpack, accumulate=_compiled_accumulate,
    gather_chunks=_compiled_gather_chunks, scatter_chunks=_compiled_scatter_chunks,
    abs_max=_compiled_abs_max)
compiled.__doc__ = ("The compiled kernels, called explicitly (same arguments as the public "
                    "functions plus simd=True; RuntimeError if the library is unavailable).")


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------

Scale = Union[float, tf.Tensor, Sequence[float]]


def pack(tensors: Sequence[tf.Tensor], wire_dtype: tf.DType = tf.float16,
         scale: Scale = 1.0) -> tf.Tensor:
    """Flattens, scales and casts `tensors` into one contiguous buffer.

    Args:
      tensors: N floating tensors (float16, bfloat16, float32, float64), any
        shapes, possibly empty.
      wire_dtype: dtype of the buffer: tf.float16, tf.bfloat16 or tf.float32.
      scale: prescale, a float or float32 tensor of shape [] (every element)
        or [N] (tensor i times scale[i]), e.g. 1/num_replicas or a power of two
        per tensor. The product is formed in float32 (in float64 for float64
        inputs, which are then rounded once, to the wire dtype). Round to
        nearest even; values beyond the wire range become +-inf; NaN stays NaN.

    Returns:
      1-D `wire_dtype` tensor of sum(size(t)) elements, in list order.

    Raises:
      TypeError: a tensor is not floating, a scale tensor is not float32.
      ValueError: bad wire_dtype; scale not of shape [] or [N]
        (tf.errors.InvalidArgumentError when only known at run time).
    """
    tensors = list(tensors)
    return _implementation(tensors).pack(tensors, wire_dtype, scale)


def unpack(buffer: tf.Tensor, shapes: Sequence[tf.TensorShape],
           dtypes: Sequence[tf.DType], scale: Scale = 1.0) -> List[tf.Tensor]:
    """Inverse of `pack`: splits `buffer` into tensors of `shapes`/`dtypes`.

    Output i is cast(float32(segment i) * scale[i]) to dtypes[i] (the
    product in float32); `scale` (postscale) is a float or float32 tensor of
    shape [] (one for all) or [len(shapes)]. Shapes must be fully defined.

    Raises:
      ValueError: the buffer's static length is not the sum of the shapes'
        sizes, a shape is not fully defined, or scale is not of shape [] or
        [len(shapes)] (tf.errors.InvalidArgumentError when only known at run
        time). TypeError: a scale tensor is not float32.
    """
    return _implementation([buffer]).unpack(buffer, list(shapes), list(dtypes), scale)


def abs_max(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Largest magnitude of each tensor: the bound a wire scale is chosen from.

    Args:
      tensors: N floating tensors (float16, bfloat16, float32, float64), any shapes.

    Returns:
      float32 [N]: max |tensors[i]|; 0 for an empty tensor, NaN if the tensor
      holds a NaN, else inf if it holds +-inf. Exact for 16- and 32-bit
      inputs; a float64 maximum is rounded to the nearest float32 (values
      beyond float32's range give inf).

    Raises:
      TypeError: a tensor is not floating.
    """
    tensors = list(tensors)
    return _implementation(tensors).abs_max(tensors)


def accumulate(residual: tf.Tensor, tensors: Sequence[tf.Tensor], chunk_size: int,
               velocity: Optional[tf.Tensor] = None, momentum: float = 0.0
               ) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
    """Error-feedback accumulation and chunk importance in one pass (CSC).

    g = pack(tensors, float32); with `velocity`: u = momentum * velocity + g
    (momentum correction) and g = u. acc = residual + g.

    Args:
      residual: float32 [n].
      tensors: floating tensors whose sizes sum to n.
      chunk_size: elements per chunk (>= 1).
      velocity: optional float32 [n].

    Returns:
      (acc float32 [n], norms float32 [ceil(n / chunk_size)] = per-chunk L1
      norm of acc, new velocity float32 [n] or None).

    Raises:
      ValueError or tf.errors.InvalidArgumentError naming the problem:
      chunk_size < 1, sizes that do not match.
    """
    tensors = list(tensors)
    return _implementation([residual] + tensors).accumulate(
        residual, tensors, chunk_size, velocity, momentum)


def gather_chunks(acc: tf.Tensor, indices: tf.Tensor, chunk_size: int,
                  wire_dtype: tf.DType = tf.float16, scale: Scale = 1.0,
                  velocity: Optional[tf.Tensor] = None
                  ) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
    """Gathers the chunks `indices` of `acc` into a dense wire buffer.

    Args:
      acc: float32 [n].
      indices: int32 (or int64) [k], sorted ascending, unique, in [0, num_chunks).
      chunk_size: elements per chunk (>= 1).
      wire_dtype: as in `pack`.
      scale: a float or float32 tensor of shape [] (every chunk) or [k]
        (chunk indices[j] times scale[j]), in float32 before the cast, with
        the rounding of `pack`.
      velocity: optional float32 [n], masked like the residual.

    Returns:
      (selected `wire_dtype` [m], m = elements in those chunks; residual
      float32 [n] = acc with those chunks set to 0; velocity with those
      chunks set to 0, or None).

    Raises:
      ValueError or tf.errors.InvalidArgumentError naming the problem:
      chunk_size < 1, out-of-range, unsorted or duplicate indices, scale not
      of shape [] or [k]. TypeError: a scale tensor is not float32.
    """
    return _implementation([acc]).gather_chunks(acc, indices, chunk_size, wire_dtype,
                                                scale, velocity)


def scatter_chunks(selected: tf.Tensor, indices: tf.Tensor, chunk_size: int,
                   shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType],
                   scale: Scale = 1.0) -> List[tf.Tensor]:
    """Inverse of `gather_chunks` straight into unpacked tensors.

    Positions outside the chunks `indices` are 0; inside chunk indices[j],
    float32(selected values) * scale[j] (or * scale, for shape []), cast to
    each output dtype. scale: a float or float32 tensor of shape [] or [k].

    Raises:
      ValueError or tf.errors.InvalidArgumentError naming the problem: bad
      indices (as in `gather_chunks`), `selected` not as long as the chunks,
      scale not of shape [] or [k]. TypeError: a scale tensor is not float32.
    """
    return _implementation([selected]).scatter_chunks(
        selected, indices, chunk_size, list(shapes), list(dtypes), scale)
