"""GradientFlowStats(profile_dir=...) traces one training step with tf.profiler (issue 18 item 3)."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.keras.callbacks import StepProfile


def _events(path):
    """{event name: count} of every line of every plane of one .xplane.pb trace."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    names = {}
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                names[name] = names.get(name, 0) + 1
    return names


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
    names = _events(traces[0])
    assert any("CollectiveReduce" in name for name in names), sorted(names)[:50]
    assert any("GfPack" in name or "Pack" in name for name in names), sorted(names)[:50]
    assert stats.profile.done and stats.stats.totals()["steps"] == 8   # 2 epochs x 4 batches


def test_step_profile_rejects_a_negative_batch_and_gradient_flow_stats_defaults_to_no_trace():
    with pytest.raises(ValueError, match="batch must be an integer >= 0"):
        StepProfile("/tmp/unused", batch=-1)
    stats = gf_tf.GradientFlowStats(gf_tf.GradientFlowAllReduce(compression="fp16"))
    assert stats.profile is None
