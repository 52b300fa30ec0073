"""gf_tf.checks: the shared argument checks, and settings given as NumPy numbers kept as Python's."""

import math

import numpy as np
import pytest

import gf_tf
from gf_tf.checks import is_int_at_least, is_number_in


@pytest.mark.parametrize("value, low, expected", [
    (3, 1, True), (np.int64(3), 1, True), (np.uint8(0), 0, True), (0, 1, False),
    (True, 0, False), (np.bool_(True), 0, False), (2.0, 1, False), ("2", 1, False), (None, 0, False),
])
def test_whole_numbers(value, low, expected):
    assert is_int_at_least(value, low) is expected


@pytest.mark.parametrize("value, args, expected", [
    (0.5, (0.0, 1.0), True), (np.float32(0.5), (0.0, 1.0), True), (1, (0.0, 1.0), True),
    (0.0, (0.0, 1.0), True), (0.0, (0.0, 1.0, True), False), (1.0, (0.0, 1.0, False, True), False),
    (math.nan, (0.0, 1.0), False), (np.float64("nan"), (-math.inf, math.inf), False),
    (False, (0.0, 1.0), False), ("0.5", (0.0, 1.0), False), (math.inf, (0.0, math.inf, True, True), False),
])
def test_numbers_in_a_range(value, args, expected):
    assert is_number_in(value, *args) is expected


def test_numpy_settings_are_kept_as_python_numbers():
    sparsity = gf_tf.ChunkSparsity(density=np.float32(0.25), chunk_size=np.int64(64),
                                   warmup_steps=np.int32(3), momentum=np.float64(0.5))
    assert [type(v) for v in (sparsity.chunk_size, sparsity.warmup_steps, sparsity.momentum)] == \
        [int, int, float]
    assert (sparsity.chunk_size, sparsity.warmup_steps, sparsity.density) == (64, 3, 0.25)
    low_rank = gf_tf.reducers.LowRank(rank=np.int64(2), warmup_steps=np.int16(5))
    assert (type(low_rank.rank), type(low_rank.warmup_steps)) == (int, int)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        gf_tf.ChunkSparsity(chunk_size=np.int64(0))
    with pytest.raises(ValueError, match="momentum must be in"):
        gf_tf.ChunkSparsity(momentum=np.float32("nan"))
