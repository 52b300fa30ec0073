"""GradientFlowStats(profile_dir=...) traces one training step with tf.profiler (issue 18 item 3)."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.keras.callbacks import StepProfile


def _ops_by_thread(path):
    """{thread pool (a trace line's name up to "/"): set of op types} of one .xplane.pb trace
    (an op's event is named "<op name>:<op type>")."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    ops = {}
    for plane in space.planes:
        for line in plane.lines:
            found = ops.setdefault(line.name.split("/")[0], set())
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" in name:
                    found.add((name.rsplit(":", 1)[1], "gradient_tape/" in name))
    return ops


def test_gradient_flow_stats_traces_one_step_with_its_collectives(tmp_path):
    import keras  # pylint: disable=import-outside-toplevel
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0, algorithm="ring")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=gradient_flow)
    rng = np.random.default_rng()
    x = rng.standard_normal((64, 8)).astype("float32")
    y = rng.integers(0, 3, 64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stats = gf_tf.GradientFlowStats(gradient_flow, profile_dir=str(tmp_path), profile_batch=2)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[stats])
    traces = glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1, traces            # one batch of the first epoch, not one per epoch
    ops = _ops_by_thread(traces[0])
    # What README's "Reading a step's trace" says to look for: the collectives on their own
    # threads, GradientFlow's packing and the backprop ops on TF's inter-op pool (tf_Compute).
    assert ("CollectiveReduceV2", False) in ops.get("collective_ops", set()), ops
    compute = ops.get("tf_Compute", set())
    assert ("GfPack", False) in compute and any(backprop for _, backprop in compute), ops
    assert stats.profile.done and stats.stats.totals()["steps"] == 8   # 2 epochs x 4 batches


def test_step_profile_rejects_a_negative_batch_and_gradient_flow_stats_defaults_to_no_trace():
    with pytest.raises(ValueError, match="batch must be an integer >= 0"):
        StepProfile("/tmp/unused", batch=-1)
    stats = gf_tf.GradientFlowStats(gf_tf.GradientFlowAllReduce(compression="fp16"))
    assert stats.profile is None
