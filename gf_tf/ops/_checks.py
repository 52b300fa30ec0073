"""Argument checks of gf_tf.ops, shared by the compiled and the composite implementations.

The errors raised here are the public functions' documented errors (see gf_tf/ops/__init__.py); both
implementations call the same check, so they raise the same error for the same bad input.
"""

import numbers
from typing import List, Optional

import numpy as np
import tensorflow as tf

# The dtype sets of the ops (the one place on the Python side, re-exported by gf_tf.ops;
# ops/gf_kernels.h has the same sets for the op registrations).
GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)  # tensors packed and unpacked
WIRE_DTYPES = (tf.float16, tf.bfloat16, tf.float32)              # buffers on the wire

# What a vector `scale` holds, per op (the kernels' messages say the same).
PER_TENSOR = "one scale per input tensor"
PER_OUTPUT = "one scale per output tensor"
PER_CHUNK = "one scale per selected chunk, k = len(indices)"


def dtype_names(dtypes) -> str:
    names = [d.name for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def chunk_size(size: int) -> int:
    """`size` itself; raises ValueError if it is below 1."""
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1 element, got {size}")
    return size


def floating_tensors(tensors, what: str) -> List[tf.Tensor]:
    out = []
    for i, t in enumerate(tensors):
        t = tf.convert_to_tensor(t)
        if t.dtype not in GRAD_DTYPES:
            raise TypeError(f"{what}: tensors[{i}] has dtype {t.dtype.name}; only "
                            f"{dtype_names(GRAD_DTYPES)} tensors are accepted")
        out.append(t)
    return out


def wire(wire_dtype) -> tf.DType:
    wire_dtype = tf.as_dtype(wire_dtype)
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be {dtype_names(WIRE_DTYPES)}, got {wire_dtype.name}")
    return wire_dtype


def shapes_and_sizes(shapes, dtypes, what: str):
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


def unpack_arguments(buffer, shapes, dtypes):
    """unpack's buffer (a tensor, its static length checked), shapes, dtypes and sizes."""
    shapes, dtypes, sizes = shapes_and_sizes(shapes, dtypes, "unpack")
    buffer = tf.convert_to_tensor(buffer)
    static_length(buffer, sum(sizes), "unpack", "the packed buffer")
    return buffer, shapes, dtypes, sizes


def static_length(t, expected: int, what: str, name: str) -> None:
    n = t.shape[0] if t.shape.rank == 1 else None
    if t.shape.rank not in (None, 1):
        raise ValueError(f"{what}: {name} must be 1-D, got shape {t.shape}")
    if n is not None and n != expected:
        raise ValueError(f"{what}: {name} has {n} elements but {expected} are expected")


def flat_float32(t, what: str, name: str) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    if t.dtype != tf.float32:
        raise TypeError(f"{what}: {name} must be float32, got {t.dtype.name}")
    if t.shape.rank not in (None, 1):
        raise ValueError(f"{what}: {name} must be 1-D, got shape {t.shape}")
    return t


def lookahead(requested: bool, velocity) -> bool:
    """accumulate's `lookahead` flag; raises ValueError if it is set without a velocity."""
    if requested and velocity is None:
        raise ValueError("accumulate: lookahead=True needs a velocity (the L1 norms of "
                         "acc + momentum * u are defined with momentum correction only)")
    return bool(requested)


def indices(chunk_indices) -> tf.Tensor:
    chunk_indices = tf.convert_to_tensor(chunk_indices)
    if chunk_indices.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"indices must be int32 or int64, got {chunk_indices.dtype.name}")
    return chunk_indices


def static_count(chunk_indices) -> Optional[int]:
    """len(indices) where it is known statically, else None."""
    return chunk_indices.shape[0] if chunk_indices.shape.rank == 1 else None


def scale(value, count: Optional[int], what: str, items: str):
    """Checks a `scale` argument; returns it as a float (Python number) or a float32 tensor.

    Python numbers are rounded to float32 (the kernels' arithmetic) and stay
    Python floats; anything else becomes a float32 tensor of shape [] or
    [count] (checked here where static, in the kernels / the composite's
    run-time check otherwise). `count` None: not known statically.
    """
    if tf.is_tensor(value):
        if value.dtype != tf.float32:
            raise TypeError(f"{what}: scale must be float32, got {value.dtype.name}; "
                            "cast it with tf.cast(scale, tf.float32)")
    else:
        with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as in the kernels
            if isinstance(value, numbers.Real):
                return float(np.float32(value))
            value = tf.constant(np.asarray(value, np.float32))
    shape = value.shape
    if shape.rank in (None, 0) or (shape.rank == 1 and None in (shape[0], count)) or \
            (shape.rank == 1 and shape[0] == count):
        return value
    got = ",".join("?" if d is None else str(d) for d in shape.as_list())
    expected = "?" if count is None else count
    raise ValueError(f"{what}: scale must have shape [] or [{expected}] ({items}), got [{got}]")


def lowrank_factors(what: str, matrix, *factors, grad: bool = False) -> list:
    """The low-rank ops' arguments as tensors, their dtypes checked (`matrix` float32, or any
    GRAD_DTYPES dtype with `grad`; each (name, factor) float32) and, where known statically,
    their rank (2). Whether the shapes pair is the kernels' check (or the composite's matmul)."""
    matrix = tf.convert_to_tensor(matrix)
    if matrix.dtype not in (GRAD_DTYPES if grad else (tf.float32,)):
        raise TypeError(f"{what}: the matrix has dtype {matrix.dtype.name}; "
                        f"{dtype_names(GRAD_DTYPES) if grad else 'float32'} accepted")
    out = [matrix]
    for name, f in factors:
        f = tf.convert_to_tensor(f)
        if f.dtype != tf.float32:
            raise TypeError(f"{what}: {name} must be float32, got {f.dtype.name}")
        out.append(f)
    for t, name in zip(out, ["matrix"] + [name for name, _ in factors]):
        if t.shape.rank not in (None, 2):
            raise ValueError(f"{what}: {name} must be 2-D, got shape {t.shape}")
    return out
