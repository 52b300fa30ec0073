"""Wire formats of mixed-precision communication (a registry), and how values are scaled into their range.

Source: GradientFlow (arXiv 1902.06855), "mixed-precision communication":
float32 gradients travel as float16 and the arithmetic stays float32.

FP16 covers magnitudes from 6e-8 (subnormal) to 65504, so every value is
multiplied by a power of two before the cast (prescale) and divided by it
after the all-reduce (postscale). The scale is chosen from a bound that all
replicas agree on: the SUM over replicas of each replica's max |x| (per tensor
for dense packs, the chunk L1 norms for CSC). That bound is at least every
partial sum a ring all-reduce forms, so with `2**15 / bound` rounded down to
a power of two no partial sum can reach 65504, while the largest value lands
within a factor 2 of `2**15`: small gradients keep FP16's full precision at any
replica count. A power of two multiplies exactly (no rounding of its own).
BF16 has float32's range and float32 needs no scaling: their scale is 1.
"""

import dataclasses
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from gf_tf import ops



@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One wire format of packed float32 gradients.

    Source: GradientFlow (arXiv 1902.06855), "mixed-precision communication".
    Register one with `register`; `GradientFlowAllReduce(compression=name)` then
    selects it.

    Attributes:
      name: what users pass as `compression` ("fp16", "bf16", ...; None: each pack
        travels in its own dtype, float32 as float32).
      dtype: what float32 values travel as (None: their own dtype); one of
        `gf_tf.ops.WIRE_DTYPES`.
      scaled: values must be scaled into the dtype's range (by a power of two chosen
        from an all-reduced bound, `power_of_two_scale`): the packs then need their
        all-reduced bounds first, one control collective. Read per pack from the format it
        travels on (`gf_tf.packing.PackSpec.wire`, `pack_format`).
      auto: compression="auto" may choose it (the planner weighs it against
        TensorFlow's own all-reduce).
    """
    name: Optional[str]
    dtype: Optional[tf.DType]
    scaled: bool = False
    auto: bool = False

    @property
    def method(self) -> str:
        """The planner's name of this wire (`gf_tf.plan.Plan.method`): the name, or "none"."""
        return self.name or NO_COMPRESSION

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire per float32 gradient element."""
        return self.dtype.size if self.dtype is not None else 4

    @property
    def exact(self) -> bool:
        """float32 travels as float32: nothing saved over TensorFlow's own all-reduce but
        the algorithm."""
        return self.wire_bytes == 4


NO_COMPRESSION = "none"   # the planner's name of the None format

# Wire formats by name: adding a format is one `register` call (plus the dtype in the op
# library, gf_tf.ops.WIRE_DTYPES, if it is a new one).
FORMATS: Dict[Optional[str], WireFormat] = {}
PACKABLE_DTYPES = ops.WIRE_DTYPES   # gradients that can travel packed: the wire dtypes themselves


def register(wire_format: WireFormat) -> WireFormat:
    """Adds (or replaces) a wire format under its name; returns it.

    Every worker must register the same formats.

    Raises:
      ValueError: the format's dtype is one the op library cannot pack to
        (`gf_tf.ops.WIRE_DTYPES`), or its name is "none" (the planner's name of the
        None format).
    """
    if wire_format.dtype is not None and wire_format.dtype not in ops.WIRE_DTYPES:
        raise ValueError(f"wire format {wire_format.name!r}: the op library packs to "
                         f"{[d.name for d in ops.WIRE_DTYPES]}, not {wire_format.dtype.name}")
    if wire_format.name == NO_COMPRESSION:
        raise ValueError(f"{NO_COMPRESSION!r} is the planner's name of the None format")
    FORMATS[wire_format.name] = wire_format
    return wire_format


register(WireFormat(None, None, auto=True))
FP16 = register(WireFormat("fp16", tf.float16, scaled=True, auto=True))
BF16 = register(WireFormat("bf16", tf.bfloat16))
# 16-bit gradients travel as themselves, on their dtype's built-in format (these, never another
# registered format of the same dtype): float16 scaled into its range, bfloat16 unscaled.
NATIVE_FORMATS = {tf.float16: FP16, tf.bfloat16: BF16}


def get(name: Optional[str]) -> WireFormat:
    """The registered format a user names as `compression` (None: packs in their own dtype).

    Raises:
      ValueError: an unknown name (the message lists the registered ones).
    """
    if name not in FORMATS:
        raise ValueError(f"compression must be \"auto\" or one of {list(FORMATS)}, got {name!r}")
    return FORMATS[name]


def format_of(method: str) -> WireFormat:
    """The wire format of a planner method name ("none" is the None format).

    Raises:
      ValueError: an unknown name (the message lists the registered ones).
    """
    return get(None if method == NO_COMPRESSION else method)


def pack_format(wire_format: WireFormat, dtype: tf.DType) -> WireFormat:
    """The format a pack of `dtype` values travels on when float32 packs travel on `wire_format`:
    float32 -> `wire_format`; float16 and bfloat16 -> their built-in format (`NATIVE_FORMATS`),
    whatever else is registered with their dtype.

    Raises:
      ValueError: a dtype that cannot be packed (not in PACKABLE_DTYPES).
    """
    dtype = tf.as_dtype(dtype)
    if dtype not in PACKABLE_DTYPES:
        raise ValueError(f"cannot pack {dtype.name}; packable dtypes are "
                         f"{[d.name for d in PACKABLE_DTYPES]}")
    return wire_format if dtype == tf.float32 else NATIVE_FORMATS[dtype]


# Scaled values stay below this (a power of two below float16's max, 65504),
# so a sum that FP16 rounds up by a few ulps is still finite.
SCALE_TARGET_EXPONENT = 15
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126   # float32 normal powers of two
_SMALLEST_NORMAL = 2.0 ** -126


def power_of_two_scale(bound: tf.Tensor) -> tf.Tensor:
    """Prescale for values whose all-reduced magnitude bound is `bound`.

    Args:
      bound: float32, any shape: SUM over replicas of max |x| (or of L1 norms).

    Returns:
      float32 of the same shape: `2**e` with `e = floor(log2(2**15 / bound))`,
      clipped to [-126, 126]; 1 where the bound is inf or NaN (so a
      non-finite gradient stays non-finite and reaches the loss scaler), 0,
      or below float32's smallest normal number `2**-126` (TensorFlow's CPU
      kernels flush such subnormals to zero).
      `bound * scale < 2**15` wherever the bound is finite.
    """
    bound = tf.convert_to_tensor(bound, tf.float32)
    usable = tf.math.is_finite(bound) & (bound >= _SMALLEST_NORMAL)
    safe = tf.where(usable, bound, tf.ones_like(bound))
    # frexp-style exponent, exact in float32: bound = m * 2**ebound, m in [1, 2).
    exponent = tf.math.floor(tf.math.log(safe) / np.log(2.0))
    # log() may be off by one ulp near powers of two: correct against the bound itself.
    exponent += tf.cast(tf.pow(2.0, exponent + 1.0) <= safe, tf.float32)
    exponent -= tf.cast(tf.pow(2.0, exponent) > safe, tf.float32)
    e = tf.clip_by_value(SCALE_TARGET_EXPONENT - 1.0 - exponent, _MIN_EXPONENT, _MAX_EXPONENT)
    return tf.where(usable, tf.pow(2.0, e), tf.ones_like(bound))


# Scaled a step ahead (`gf_tf.reducers.dense`; CSC's selection="ahead" forecasts its own scale):
# the prescale of the previous step's bound with AHEAD_HEADROOM_BITS of room to grow (the summed
# bound lands in [2**(14-h), 2**(15-h))); the dense reducer keeps the values when this step's summed bound is
# finite, at most 2**15 (no partial sum near 65504), and, where not 0, at least
# 2**(14-h-AHEAD_SHRINK_BITS) (small values keep nearly all the precision the exact scale gives
# them: docs/fp16.md); else the pack is sent again in float32.
AHEAD_HEADROOM_BITS = 5
AHEAD_SHRINK_BITS = 6
# Bits of a hash of each worker's previous bounds that travel (as b and 1 - b) so that workers
# whose bounds differ retry: they pass unseen with probability 2**-AGREEMENT_BITS.
AGREEMENT_BITS = 16
AHEAD_CEILING = 2.0 ** SCALE_TARGET_EXPONENT
AHEAD_FLOOR = 2.0 ** (SCALE_TARGET_EXPONENT - 1 - AHEAD_HEADROOM_BITS - AHEAD_SHRINK_BITS)


def ahead_scale(previous_bound: tf.Tensor) -> tf.Tensor:
    """Prescale of a step whose previous step's all-reduced bound was `previous_bound`.

    Args:
      previous_bound: float32 [T]: SUM over replicas of each tensor's max |x| a step before
        (NaN: none).

    Returns:
      float32 [T]: `power_of_two_scale(previous_bound) / 2**AHEAD_HEADROOM_BITS`, a power of
      two (2**-AHEAD_HEADROOM_BITS where the bound is 0, not finite or below 2**-126).
    """
    return power_of_two_scale(previous_bound) * 2.0 ** -AHEAD_HEADROOM_BITS


def ahead_slots(tensors: int) -> int:
    """Slots (wire elements) a pack of `tensors` tensors scaled a step ahead carries after its
    values: per tensor its bound and a non-zero count, an unknown-bound count, and the bounds'
    hash bits as b and 1 - b (`gf_tf.reducers.dense`)."""
    return 2 * tensors + 1 + 2 * AGREEMENT_BITS


def ahead_fits(summed: tf.Tensor, nonzero: tf.Tensor) -> tf.Tensor:
    """Whether values scaled a step ahead are kept (`ahead_scale`): per tensor, its bound this
    step times the prescale (float32 [T], summed over replicas on the wire) is finite, at most
    AHEAD_CEILING, and at least AHEAD_FLOOR unless every replica's max is 0 (`nonzero`: float32
    [T], the count of replicas whose max |x| is not 0). bool [T]."""
    return (tf.math.is_finite(summed) & (summed <= AHEAD_CEILING)
            & ((summed >= AHEAD_FLOOR) | tf.equal(nonzero, 0.0)))


def power_of_two_scale_np(bound: np.ndarray) -> np.ndarray:
    """NumPy twin of `power_of_two_scale` (float64 in, float64 out), for models and tests."""
    bound = np.asarray(bound, np.float64)
    usable = np.isfinite(bound) & (bound >= _SMALLEST_NORMAL)
    _, exponent = np.frexp(np.where(usable, bound, 1.0))    # bound = m * 2**exponent, m in [0.5, 1)
    e = np.clip(SCALE_TARGET_EXPONENT - exponent, _MIN_EXPONENT, _MAX_EXPONENT)
    return np.where(usable, np.ldexp(1.0, e), 1.0)
