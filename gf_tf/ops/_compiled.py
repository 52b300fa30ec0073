"""The compiled implementation of gf_tf.ops: thin wrappers over the kernels of ops/*.cc.

Each checks its arguments in Python where the check is static (the same checks and errors
as the composite), leaves the rest to the kernels, and raises RuntimeError if the library
is unavailable. `simd=False` forces the kernels' portable scalar code (tests).
gf_tf/ops/__init__.py documents each function.
"""

import tensorflow as tf

from gf_tf.ops import _checks as checks
from gf_tf.ops import _library as library


def _scale_tensor(scale, count, what: str, items: str) -> tf.Tensor:
    """The `scale` input of a kernel: checked (checks.scale) and always a float32 tensor."""
    scale = checks.scale(scale, count, what, items)
    return tf.constant(scale, tf.float32) if isinstance(scale, float) else scale


def _chunk_scale(scale, indices, what: str) -> tf.Tensor:
    return _scale_tensor(scale, checks.static_count(indices), what, checks.PER_CHUNK)


def _optional(velocity, what: str) -> list:
    """The kernels' optional velocity input: a list of none or one float32 tensor."""
    return [] if velocity is None else [checks.flat_float32(velocity, what, "velocity")]


def pack(tensors, wire_dtype, scale=1.0, simd=True):
    lib = library.require()
    tensors = checks.floating_tensors(tensors, "pack")
    wire_dtype = checks.wire(wire_dtype)
    scale = _scale_tensor(scale, len(tensors), "pack", checks.PER_TENSOR)
    if not tensors:
        return tf.zeros([0], wire_dtype)
    return lib.gf_pack(tensors, scale, wire_dtype=wire_dtype, simd=simd)


def unpack(buffer, shapes, dtypes, scale=1.0, simd=True):
    lib = library.require()
    buffer, shapes, dtypes, sizes = checks.unpack_arguments(buffer, shapes, dtypes)
    scale = _scale_tensor(scale, len(sizes), "unpack", checks.PER_OUTPUT)
    if not sizes:
        return []
    return lib.gf_unpack(buffer, scale, Tout=dtypes, shapes=shapes, simd=simd)


def abs_max(tensors, simd=True):
    lib = library.require()
    tensors = checks.floating_tensors(tensors, "abs_max")
    if not tensors:
        return tf.zeros([0], tf.float32)
    return lib.gf_abs_max(tensors, simd=simd)


def accumulate(residual, tensors, chunk_size, velocity, momentum, lookahead=False, simd=True):
    lib = library.require()
    residual = checks.flat_float32(residual, "accumulate", "residual")
    tensors = checks.floating_tensors(tensors, "accumulate")
    lookahead = checks.lookahead(lookahead, velocity)
    acc, norms, new_velocity, ahead = lib.gf_accumulate(
        residual, tensors, _optional(velocity, "accumulate"), chunk_size=int(chunk_size),
        momentum=float(momentum), with_lookahead=lookahead, simd=simd)
    outputs = acc, norms, (new_velocity[0] if new_velocity else None)
    return outputs + (ahead,) if lookahead else outputs


def gather_chunks(acc, indices, chunk_size, wire_dtype, scale=1.0, velocity=None, simd=True):
    lib = library.require()
    acc = checks.flat_float32(acc, "gather_chunks", "acc")
    indices = checks.indices(indices)
    scale = _chunk_scale(scale, indices, "gather_chunks")
    selected, residual, new_velocity = lib.gf_gather_chunks(
        acc, indices, scale, _optional(velocity, "gather_chunks"), chunk_size=int(chunk_size),
        wire_dtype=checks.wire(wire_dtype), simd=simd)
    return selected, residual, (new_velocity[0] if new_velocity else None)


def scatter_chunks(selected, indices, chunk_size, shapes, dtypes, scale=1.0, simd=True):
    lib = library.require()
    shapes, dtypes, _ = checks.shapes_and_sizes(shapes, dtypes, "scatter_chunks")
    indices = checks.indices(indices)
    scale = _chunk_scale(scale, indices, "scatter_chunks")
    if not shapes:
        return []
    return lib.gf_scatter_chunks(
        tf.convert_to_tensor(selected), indices, scale, chunk_size=int(chunk_size),
        Tout=dtypes, shapes=shapes, simd=simd)


def lowrank_project(grad, residual, q):
    lib = library.require()
    grad, residual, q = checks.lowrank_factors("lowrank_project", grad, ("residual", residual),
                                               ("q", q), grad=True)
    return tuple(lib.gf_low_rank_project(grad, residual, q))


def lowrank_project_back(matrix, p):
    lib = library.require()
    return lib.gf_low_rank_project_back(*checks.lowrank_factors("lowrank_project_back", matrix,
                                                                ("p", p)))


def lowrank_reconstruct(matrix, a, b, c, d, dtype):
    lib = library.require()
    args = checks.lowrank_factors("lowrank_reconstruct", matrix, ("a", a), ("b", b), ("c", c),
                                  ("d", d))
    return tuple(lib.gf_low_rank_reconstruct(*args, Tout=tf.as_dtype(dtype)))
