"""A 2-replica MirroredStrategy fit with GradientFlowStats(profile_dir=...) (tests/test_step_profile.py).

Its own process: one strategy with collectives per process (see mirrored_worker.py).
argv: the trace directory. Writes: steps (GradientFlow steps counted), done (the profile ran).
"""

import sys

import numpy as np
import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import gf_tf  # noqa: E402
import worker_util  # noqa: E402

gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0, algorithm="ring")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=gradient_flow)
rng = np.random.default_rng()
x = rng.standard_normal((64, 8)).astype("float32")
y = rng.integers(0, 3, 64)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
stats = gf_tf.GradientFlowStats(gradient_flow, profile_dir=sys.argv[1], profile_batch=2)
model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[stats])
worker_util.write_result(steps=stats.stats.totals()["steps"], done=stats.profile.done)
