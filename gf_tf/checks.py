"""The argument checks every layer shares: is a setting a whole number, a number in a range.

NumPy's integers and floats count as Python's do (`numbers.Integral`, `numbers.Real`); bools and
NaN do not. Callers keep the value as Python's int or float.
"""

import math
import numbers


def is_int_at_least(value, low: int) -> bool:
    """value is an integer (Python's or NumPy's, not a bool) >= low."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and bool(value >= low)


def is_number_in(value, low: float, high: float, low_open: bool = False,
                 high_open: bool = False) -> bool:
    """value is a real number (not a bool, not NaN) within [low, high], ends open where asked."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return False
    return bool((value > low if low_open else value >= low)
                and (value < high if high_open else value <= high))
