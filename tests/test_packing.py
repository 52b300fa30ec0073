"""The pack plan (gf_tf/packing.py) and wire formats (gf_tf/wire.py)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf

from gf_tf import wire
from gf_tf.wire import FORMATS, pack_format
from gf_tf.packing import plan_fingerprint, plan_packs

FP16 = FORMATS["fp16"]


def sig(*entries):
    return [None if e is None else (tf.TensorShape(e[0]), e[1]) for e in entries]


def test_many_tiny_tensors_fill_packs_up_to_bytes_per_pack():
    # 100 float32 tensors of 10 elements = 20 wire bytes each in FP16: 51 fit in 1024 bytes.
    plan = plan_packs(sig(*[((10,), tf.float32)] * 100), 1024, FP16)
    assert [len(p.indices) for p in plan] == [51, 49]
    assert [p.num_bytes for p in plan] == [1020, 980]
    assert all(p.wire_dtype == tf.float16 for p in plan)
    assert sorted(i for p in plan for i in p.indices) == list(range(100))


def test_packs_follow_backprop_order():
    plan = plan_packs(sig(*[((4,), tf.float32)] * 6), 16, FP16)  # 8 bytes each: 2 per pack
    assert [p.indices for p in plan] == [(5, 4), (3, 2), (1, 0)]


def test_tensor_larger_than_bytes_per_pack_gets_its_own_pack():
    plan = plan_packs(sig(((2,), tf.float32), ((1000,), tf.float32), ((3,), tf.float32)), 64, FP16)
    assert [p.indices for p in plan] == [(2,), (1,), (0,)]
    assert plan[1].num_bytes == 2000


def test_dtypes_are_packed_separately_and_unpackable_values_skipped():
    plan = plan_packs(sig(((3, 4), tf.float32), None, ((10,), tf.float16), ((5,), tf.bfloat16),
                          ((2,), tf.float32)), 1 << 20, FP16)
    by_dtype = {p.dtypes[0]: p for p in plan}
    assert set(by_dtype) == {tf.float32, tf.float16, tf.bfloat16}
    assert by_dtype[tf.float32].indices == (4, 0)
    assert by_dtype[tf.float32].num_elements == 14
    assert by_dtype[tf.float16].wire_dtype == tf.float16
    assert by_dtype[tf.bfloat16].wire_dtype == tf.bfloat16  # 16-bit values travel as themselves
    assert all(1 not in p.indices for p in plan)
    assert [p.indices[0] for p in plan] == [4, 3, 2]  # ordered by first backprop position


def test_zero_bytes_per_pack_means_one_pack_per_dtype():
    plan = plan_packs(sig(*[((1000,), tf.float32)] * 5), 0, FP16)
    assert len(plan) == 1 and plan[0].num_elements == 5000


def test_zero_size_tensors_are_packed_with_no_bytes():
    plan = plan_packs(sig(((0,), tf.float32), ((3, 0), tf.float32), ((7,), tf.float32)), 8, FP16)
    assert sum(p.num_elements for p in plan) == 7
    assert sorted(i for p in plan for i in p.indices) == [0, 1, 2]


def test_plan_depends_only_on_the_ordered_signature():
    entries = [((3, 4), tf.float32), ((10,), tf.float16), ((7,), tf.float32)]
    a = plan_packs(sig(*entries), 32, FP16)
    b = plan_packs([(tf.TensorShape(list(s)), tf.as_dtype(d.name)) for s, d in entries], 32,
                   wire.get("fp16"))
    assert [(p.key, p.indices) for p in a] == [(p.key, p.indices) for p in b]
    swapped = plan_packs(sig(entries[2], entries[1], entries[0]), 32, FP16)
    assert [p.key for p in swapped] != [p.key for p in a]
    # Keys name the pack position, dtype and size, behind a fingerprint of the whole plan.
    assert a[0].key.endswith("_p0_float32_n7")
    assert plan_fingerprint(sig(*entries), 32, FP16) != plan_fingerprint(sig(*entries), 64, FP16)


def test_compression_none_keeps_float32_on_the_wire():
    plan = plan_packs(sig(((10,), tf.float32)), 0, FORMATS[None])
    assert plan[0].wire_dtype == tf.float32 and plan[0].num_bytes == 40
    assert pack_format(FORMATS["bf16"], tf.float32).dtype == tf.bfloat16


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="bytes_per_pack"):
        plan_packs(sig(((1,), tf.float32)), -1, FP16)
    with pytest.raises(ValueError, match="fully defined"):
        plan_packs([(tf.TensorShape([None, 3]), tf.float32)], 0, FP16)
    with pytest.raises(ValueError, match="compression must be"):
        wire.get("fp8")
    with pytest.raises(ValueError, match="cannot pack float64"):
        pack_format(FP16, tf.float64)


def test_only_the_float16_wire_is_scaled():
    none = FORMATS[None]
    assert pack_format(none, tf.float16).scaled
    assert not pack_format(none, tf.bfloat16).scaled and not pack_format(none, tf.float32).scaled
