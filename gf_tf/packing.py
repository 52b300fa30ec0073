"""The pack plan of lazy all-reduce: which gradients travel together, in what order.

Pure Python over an ordered list of (shape, dtype) pairs, so every worker that
sees the same variable list derives the same plan (never from `id`, hashing
or set order). Source: GradientFlow (arXiv 1902.06855), "lazy all-reduce":
gradients are packed into buffers of at most a threshold size, in backprop
order (the reverse of the variable order), so the first pack can be
all-reduced while backprop still computes the rest.
"""

import dataclasses
import functools
import zlib
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from gf_tf.wire import PACKABLE_DTYPES, WireFormat, pack_format

# One entry per value in the caller's list: (shape, dtype) when it can be
# packed, None when it goes to the wrapped cross-device ops untouched.
Signature = Sequence[Optional[Tuple[tf.TensorShape, tf.DType]]]


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """One pack: a 1-D wire buffer made of several flattened gradients.

    key: stable name of this pack, derived only from the ordered signature and
      the plan options (e.g. "a1b2c3d4_p0_float32_n1024"); per-pack state such
      as CSC residuals is keyed by it.
    indices: positions in the caller's value list, in pack (backprop) order.
    shapes, dtypes: of those values, same order.
    num_elements: total elements (sum of the sizes).
    wire: the `gf_tf.wire.WireFormat` the buffer travels on (`gf_tf.wire.pack_format`): its
      dtype and whether values are scaled into its range.
    """
    key: str
    indices: Tuple[int, ...]
    shapes: Tuple[tf.TensorShape, ...]
    dtypes: Tuple[tf.DType, ...]
    num_elements: int
    wire: WireFormat

    @property
    def wire_dtype(self) -> tf.DType:
        """dtype of the buffer sent through the all-reduce: the format's, or (a format
        without one) the pack's own."""
        return self.wire.dtype or self.dtypes[0]

    @property
    def num_bytes(self) -> int:
        """Bytes of the wire buffer (num_elements x wire dtype size)."""
        return self.num_elements * self.wire_dtype.size


def packable_signature(values) -> Optional[Tuple[tf.TensorShape, tf.DType]]:
    """(shape, dtype) if these per-replica components of one value can be packed, else None.

    Packable: dense tf.Tensors of a PACKABLE_DTYPES dtype with one fully defined
    shape, equal on every replica."""
    first = values[0]
    if not isinstance(first, tf.Tensor) or first.dtype not in PACKABLE_DTYPES:
        return None
    if not first.shape.is_fully_defined():
        return None
    if any(not isinstance(v, tf.Tensor) or v.shape != first.shape or v.dtype != first.dtype
           for v in values[1:]):
        return None
    return (first.shape, first.dtype)


def groups_by_dtype(indices: Sequence[int], samples) -> List[List[int]]:
    """Splits `indices` into runs of one dtype (IndexedSlices: one group per dtype too),
    ordered by first appearance: TF's collective all-reduce concatenates a batch of
    dense values, which fails for mixed dtypes. samples: one value per index."""
    groups = {}
    for i, sample in zip(indices, samples):
        kind = (isinstance(sample, tf.IndexedSlices), tf.as_dtype(sample.dtype).name)
        groups.setdefault(kind, []).append(i)
    return list(groups.values())


def plan_fingerprint(signature: Signature, bytes_per_pack: int, wire_format: WireFormat) -> int:
    """A 32-bit CRC of the signature, the pack size and the packs' wire dtypes; equal on every
    worker iff they agree."""
    text = repr((_canonical(signature), int(bytes_per_pack),
                 tuple(sorted({_wire_dtype(wire_format, s[1]).name for s in signature if s}))))
    return zlib.crc32(text.encode())


def plan_packs(signature: Signature, bytes_per_pack: int,
               wire_format: WireFormat) -> Tuple[PackSpec, ...]:
    """Cuts the packable values of `signature` into packs.

    Args:
      signature: per caller value, (fully defined shape, dtype) or None (not
        packed).
      bytes_per_pack: the lazy all-reduce threshold, in wire bytes. A pack is
        closed when the next value of its dtype would take it beyond this; a
        value bigger than it gets a pack of its own. 0 means one pack per
        dtype.
      wire_format: the `gf_tf.wire.WireFormat` of float32 packs; float16 and bfloat16
        packs travel on their own built-in format (`gf_tf.wire.pack_format`). Values
        are grouped per value dtype (a pack holds one dtype only).

    Returns:
      The packs, ordered by the backprop position of their first value.
      Cached: equal arguments return the same tuple.
    """
    if bytes_per_pack < 0:
        raise ValueError(f"bytes_per_pack must be >= 0 bytes, got {bytes_per_pack}")
    return _plan_cached(_canonical(signature), int(bytes_per_pack), wire_format)


def _canonical(signature: Signature):
    """Hashable, order-preserving form: ((dims...), dtype name) or None."""
    out = []
    for i, entry in enumerate(signature):
        if entry is None:
            out.append(None)
            continue
        shape, dtype = tf.TensorShape(entry[0]), tf.as_dtype(entry[1])
        if not shape.is_fully_defined():
            raise ValueError(f"value {i} has shape {shape}; packing needs fully defined "
                             "shapes (pass it as None to leave it unpacked)")
        out.append((tuple(shape.as_list()), dtype.name))
    return tuple(out)


def _wire_dtype(wire_format: WireFormat, dtype) -> tf.DType:
    """The dtype on the wire of a pack of `dtype` values (`PackSpec.wire_dtype`)."""
    return pack_format(wire_format, dtype).dtype or tf.as_dtype(dtype)


@functools.lru_cache(maxsize=256)
def _plan_cached(signature, bytes_per_pack, wire_format):
    dtypes = {entry[1] for entry in signature if entry is not None}
    wire = {name: pack_format(wire_format, name) for name in dtypes}
    wire_size = {name: _wire_dtype(wire_format, name).size for name in dtypes}
    fingerprint = plan_fingerprint(signature, bytes_per_pack, wire_format)

    closed = []   # lists of caller indices
    open_packs = {}  # dtype name -> (indices, bytes)
    backprop_order = [i for i in reversed(range(len(signature))) if signature[i] is not None]
    for i in backprop_order:
        dims, dtype = signature[i]
        size = _num_elements(dims) * wire_size[dtype]
        members, used = open_packs.get(dtype, ([], 0))
        if members and bytes_per_pack and used + size > bytes_per_pack:
            closed.append(members)
            members, used = [], 0
        open_packs[dtype] = (members + [i], used + size)
    closed.extend(members for members, _ in open_packs.values())
    rank = {i: r for r, i in enumerate(backprop_order)}
    closed.sort(key=lambda members: rank[members[0]])

    packs = []
    for p, members in enumerate(closed):
        dtype = signature[members[0]][1]
        n = sum(_num_elements(signature[i][0]) for i in members)
        packs.append(PackSpec(
            key=f"{fingerprint:08x}_p{p}_{dtype}_n{n}",
            indices=tuple(members),
            shapes=tuple(tf.TensorShape(signature[i][0]) for i in members),
            dtypes=tuple(tf.as_dtype(signature[i][1]) for i in members),
            num_elements=n,
            wire=wire[dtype]))
    return tuple(packs)


def _num_elements(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
