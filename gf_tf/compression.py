"""Wire dtypes of mixed-precision communication, with prescale/postscale.

Source: GradientFlow (arXiv 1902.06855), "mixed-precision communication":
float32 gradients travel as float16. Each replica's buffer is multiplied by
1/N before the cast (prescale) and the all-reduced sum by N after it
(postscale), so the float16 sum stays finite wherever the float32 mean is
(|mean| <= 65504); a mean beyond that comes back +-inf (never clamped).
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from gf_tf import ops
from gf_tf.packing import PackSpec

# Signature of the collective callable GradientFlowAllReduce provides: one 1-D
# tensor per local replica in, per local replica the SUM over all replicas of
# all workers out.
AllReduceSum = Callable[[List[tf.Tensor]], List[tf.Tensor]]

_WIRE_DTYPES = {"fp16": tf.float16, "bf16": tf.bfloat16, None: None}
PACKABLE_DTYPES = ops.WIRE_DTYPES  # dtypes a pack travels in (canonical set: gf_tf.ops)


@dataclasses.dataclass(frozen=True)
class Compression:
    """The wire format of dense packs.

    name: "fp16" (IEEE half, range +-65504), "bf16" (bfloat16, float32 range,
      8-bit mantissa) or None (each pack travels in its own dtype).
    """
    name: Optional[str] = "fp16"

    def __post_init__(self):
        if self.name not in _WIRE_DTYPES:
            raise ValueError(f"compression must be 'fp16', 'bf16' or None, got {self.name!r}")

    @property
    def code(self) -> int:
        """Small integer naming the setting (0 None, 1 fp16, 2 bf16), for cross-worker checks."""
        return list(_WIRE_DTYPES).index(self.name) + 1 if self.name else 0

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        """Wire dtype of a pack of `dtype` values: float32 -> the compression
        dtype; float16/bfloat16 travel as themselves (already 2 bytes)."""
        dtype = tf.as_dtype(dtype)
        if dtype not in PACKABLE_DTYPES:
            raise ValueError(f"cannot pack {dtype.name}; packable dtypes are "
                             f"{[d.name for d in PACKABLE_DTYPES]}")
        if self.name is None or dtype != tf.float32:
            return dtype
        return _WIRE_DTYPES[self.name]


def as_compression(value: Union[None, str, Compression]) -> Compression:
    """Accepts a Compression, "fp16", "bf16" or None."""
    return value if isinstance(value, Compression) else Compression(value)


def scales(wire_dtype: tf.DType, num_replicas: int, mean: bool = False) -> Tuple[float, float]:
    """(prescale, postscale) for an all-reduce of `num_replicas` replicas.

    16-bit wire: 1/N before the cast, N after it for SUM (1 for MEAN).
    32-bit wire: nothing before (float32 does not overflow), 1/N after for MEAN.
    """
    if tf.as_dtype(wire_dtype).size < 4:
        return 1.0 / num_replicas, (1.0 if mean else float(num_replicas))
    return 1.0, (1.0 / num_replicas if mean else 1.0)


def dense_all_reduce(pack: PackSpec, per_replica_grads: Sequence[Sequence[tf.Tensor]],
                     all_reduce_sum: AllReduceSum, num_replicas: int,
                     wire_dtype: tf.DType, mean: bool = False, stats=None
                     ) -> List[List[tf.Tensor]]:
    """Packs, all-reduces and unpacks one pack on every local replica.

    Args:
      pack: the PackSpec of these gradients.
      per_replica_grads: per local replica, the pack's gradient tensors (in
        `pack.indices` order), each on its replica's device.
      all_reduce_sum: see AllReduceSum.
      num_replicas: replicas over all workers (N).
      wire_dtype: the buffer dtype on the wire.
      mean: MEAN instead of SUM.
      stats: optional accumulator with add(dense_bytes=..., sent_bytes=...).

    Returns:
      Per local replica, the reduced tensors (shapes/dtypes of the pack).
      A pack of zero elements issues no collective.
    """
    prescale, postscale = scales(wire_dtype, num_replicas, mean)
    buffers = []
    for grads in per_replica_grads:
        with tf.device(grads[0].device):
            buffers.append(ops.pack(grads, wire_dtype, prescale))
    if pack.num_elements:
        buffers = all_reduce_sum(buffers)
    if stats is not None:
        stats.add(dense_bytes=4 * pack.num_elements, sent_bytes=pack.num_bytes)
    outputs = []
    for grads, buffer in zip(per_replica_grads, buffers):
        with tf.device(grads[0].device):
            outputs.append(ops.unpack(buffer, pack.shapes, pack.dtypes, postscale))
    return outputs
