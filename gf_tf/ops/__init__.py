"""GradientFlow tensor ops: pack/unpack, the chunk ops of CSC and the passes of low rank.

Every function here has two implementations with the same contract:
the compiled custom ops of ``ops/`` and an equivalent composite of stock
TensorFlow ops. The library is loaded once, lazily: ``gf_tf/_gf_tf_ops.so`` if
it was built for the running TensorFlow, else the per-TensorFlow-version cache
(``~/.cache/gf_tf/<tf version>-<abi tag>/``), compiled there on first use when a
C++ compiler is present (``gf_tf.ops._build``). The public functions pick one
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

This module is the public face (dtype sets, the functions and their contracts, the choice
of implementation). Behind it, private to the package: ``_library`` finds, builds and loads
the library; ``_build`` holds the compile command and the cache layout; ``_checks`` holds the
argument checks both implementations share; ``_composite`` and ``_compiled`` are the two
implementations (reached as the namespaces ``composite`` and ``compiled``).
"""

import types
from typing import List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.ops import _checks, _compiled, _composite, _library
from gf_tf.ops._checks import GRAD_DTYPES, WIRE_DTYPES  # noqa: F401  (the ops' dtype sets)
from gf_tf.ops._library import (  # noqa: F401  (where the library comes from)
    BUILD_COMMAND, LIBRARY_ENV, LIBRARY_FILE, VERSION_FILE_SUFFIX)

_OP_NAMES = ("pack", "unpack", "accumulate", "gather_chunks", "scatter_chunks", "abs_max",
             "lowrank_project", "lowrank_project_back", "lowrank_reconstruct")


def num_chunks(num_elements: int, chunk_size: int) -> int:
    """ceil(num_elements / chunk_size); raises ValueError if chunk_size < 1."""
    return -(-num_elements // _checks.chunk_size(chunk_size))


def library_path() -> str:
    """Path of the op library this process loaded, or else the first place it looks.

    In order: $GF_TF_OPS_LIBRARY; the package's own `gf_tf/_gf_tf_ops.so` if it was built
    for the running TensorFlow; the per-TensorFlow-version cache (`gf_tf.ops._build.cache_root()`).
    """
    return _library.path()


def library_status() -> str:
    """One line: `compiled (<path>, AVX2+F16C kernels)` or `composite (<why>)`.

    Says what runs for CPU tensors outside XLA; GPU tensors and XLA always use
    the composite ops.
    """
    return _library.status()


def _implementation_namespace(module, doc: str) -> types.SimpleNamespace:
    namespace = types.SimpleNamespace(**{name: getattr(module, name) for name in _OP_NAMES})
    namespace.__doc__ = doc
    return namespace


composite = _implementation_namespace(
    _composite, "The composite-TF implementation, called explicitly (same arguments as the "
    "public functions).")
compiled = _implementation_namespace(
    _compiled, "The compiled kernels, called explicitly (same arguments as the public "
    "functions, plus simd=True but for the low-rank ops; RuntimeError if the library is "
    "unavailable).")


def _on_cpu(tensors) -> bool:
    for t in tensors:
        device = (getattr(t, "device", "") or "").upper()
        if "GPU" in device or "TPU" in device:
            return False
    return True


def _implementation(tensors):
    if _library.load() is not None and _on_cpu(tensors) and not tf_internal.in_xla_context():
        return compiled
    return composite


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
    product in float32).

    Args:
      buffer: 1-D float16, bfloat16 or float32 tensor of sum(size(shape))
        elements (what `pack` returns).
      shapes: N fully defined shapes, in pack order.
      dtypes: N floating dtypes of the outputs.
      scale: postscale, a float or float32 tensor of shape [] (one for all) or
        [N] (output i times scale[i]).

    Returns:
      N tensors of `shapes` and `dtypes`.

    Raises:
      ValueError: the buffer's static length is not the sum of the shapes'
        sizes, a shape is not fully defined, or scale is not of shape [] or
        [len(shapes)] (tf.errors.InvalidArgumentError when only known at run
        time).
      TypeError: a scale tensor is not float32.
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
               velocity: Optional[tf.Tensor] = None, momentum: float = 0.0,
               lookahead: bool = False) -> Tuple[tf.Tensor, ...]:
    """Error-feedback accumulation and chunk importance in one pass (CSC).

    g = pack(tensors, float32); with `velocity`: u = momentum * velocity + g
    (momentum correction) and g = u. acc = residual + g.

    Args:
      residual: float32 [n].
      tensors: floating tensors whose sizes sum to n.
      chunk_size: elements per chunk (>= 1).
      velocity: optional float32 [n].
      momentum: float, the momentum of the correction (used with `velocity`).
      lookahead: also return the chunk L1 norms of acc + momentum * u (needs
        `velocity`): the part of the next step's accumulator known at this
        step, for a chunk that is not sent now. selection="ahead" scores the
        next step's chunks from them without further passes over n.

    Returns:
      (acc float32 [n], norms float32 [ceil(n / chunk_size)] = per-chunk L1
      norm of acc, new velocity float32 [n] or None), and with `lookahead` a
      fourth item, float32 [ceil(n / chunk_size)]: per chunk the sum of
      |acc + momentum * u| (each product rounded to float32, then each sum, as
      TensorFlow's `acc + momentum * u`). The order (and width, float32 or
      float64) of the norms' sums is the implementation's, so they can differ
      from a plain float32 `reduce_sum` in the last bits.

    Raises:
      ValueError: chunk_size < 1, lookahead without velocity, or sizes that do
        not match (the message names the problem; tf.errors.InvalidArgumentError
        when only known at run time).
    """
    tensors = list(tensors)
    return _implementation([residual] + tensors).accumulate(
        residual, tensors, chunk_size, velocity, momentum, lookahead)


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
      ValueError: chunk_size < 1, out-of-range, unsorted or duplicate indices,
        scale not of shape [] or [k] (the message names the problem;
        tf.errors.InvalidArgumentError when only known at run time).
      TypeError: a scale tensor is not float32.
    """
    return _implementation([acc]).gather_chunks(acc, indices, chunk_size, wire_dtype,
                                                scale, velocity)


def scatter_chunks(selected: tf.Tensor, indices: tf.Tensor, chunk_size: int,
                   shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType],
                   scale: Scale = 1.0) -> List[tf.Tensor]:
    """Inverse of `gather_chunks` straight into unpacked tensors.

    Positions outside the chunks `indices` are 0; inside chunk indices[j],
    float32(selected values) * scale[j] (or * scale, for shape []), cast to
    each output dtype.

    Args:
      selected: 1-D wire buffer of the chunks `indices` (what `gather_chunks`
        returns, all-reduced).
      indices: int32 (or int64) [k], sorted ascending, unique, in [0, num_chunks).
      chunk_size: elements per chunk (>= 1).
      shapes: fully defined shapes of the pack's tensors, in pack order.
      dtypes: floating dtypes of the outputs.
      scale: postscale, a float or float32 tensor of shape [] or [k].

    Returns:
      One tensor per shape, of that shape and dtype.

    Raises:
      ValueError: bad indices (as in `gather_chunks`), `selected` not as long
        as the chunks, scale not of shape [] or [k] (the message names the
        problem; tf.errors.InvalidArgumentError when only known at run time).
      TypeError: a scale tensor is not float32.
    """
    return _implementation([selected]).scatter_chunks(
        selected, indices, chunk_size, list(shapes), list(dtypes), scale)


def lowrank_project(grad: tf.Tensor, residual: tf.Tensor, q: tf.Tensor
                    ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Low rank's first pass over a matrix: error feedback, P_r = M_r Q and the bound of Q_r.

    Args:
      grad: [n, m] float16, bfloat16, float32 or float64: replica r's gradient as a matrix.
      residual: float32 [n, m], its residual.
      q: float32 [m, r], the warm-started factor.

    Returns:
      (matrix float32 [n, m] = float32(grad) + residual; p float32 [n, r] = matrix q;
      column_bound float32 [] = the largest column norm of matrix, 0 for m = 0: bounds
      |matrix^T p^| for p^ with unit columns). Sums in float32; their order is the
      implementation's.

    Raises:
      TypeError: grad not floating, another input not float32.
      ValueError: an input not 2-D (tf.errors.InvalidArgumentError for shapes that do not
        pair, when only known at run time).

    Source: PowerSGD (Vogels et al., NeurIPS 2019), Algorithm 2 with error feedback.
    """
    return _implementation([grad, residual, q]).lowrank_project(grad, residual, q)


def lowrank_project_back(matrix: tf.Tensor, p: tf.Tensor) -> tf.Tensor:
    """Q_r = matrix^T p: float32 [m, r] from float32 matrix [n, m] and p [n, r].

    Raises TypeError (an input not float32) or ValueError (not 2-D) as `lowrank_project`.
    Source: PowerSGD, Algorithm 1.
    """
    return _implementation([matrix, p]).lowrank_project_back(matrix, p)


def lowrank_reconstruct(matrix: tf.Tensor, a: tf.Tensor, b: tf.Tensor, c: tf.Tensor,
                        d: tf.Tensor, dtype: tf.DType = tf.float32
                        ) -> Tuple[tf.Tensor, tf.Tensor]:
    """Low rank's last pass over a matrix: the reduced gradient and the new residual.

    Args:
      matrix: float32 [n, m] (what `lowrank_project` returned).
      a: float32 [n, r], the reduced gradient's left factor.
      b: float32 [m, r], its right factor.
      c: float32 [n, r], the left factor of what is taken out of `matrix`.
      d: float32 [m, r], its right factor.
      dtype: the output's floating dtype (the gradient's).

    Returns:
      (out `dtype` [n, m] = a b^T, each element summed in float32 and rounded once;
      residual float32 [n, m] = matrix - c d^T).

    Raises TypeError or ValueError as `lowrank_project`. Source: PowerSGD, Algorithm 2.
    """
    return _implementation([matrix, a, b, c, d]).lowrank_reconstruct(matrix, a, b, c, d, dtype)
