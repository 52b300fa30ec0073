"""One worker of a 2-worker Keras model.fit with gf_tf.keras.LocalSGD (tests/test_local_sgd_multiworker.py).

Writes its weights after every batch (`after_step`: [steps, elements], flattened), the
evaluate loss after fit, the LocalSGD meetings and GradientFlow's byte totals.
"""

import argparse

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--sync_every", type=int, default=3)
parser.add_argument("--outer", default="nesterov")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--mixed_precision", action="store_true")
args = parser.parse_args()

import gf_tf  # noqa: E402  pylint: disable=wrong-import-position

strategy = gf_tf.MultiWorkerMirroredStrategy(
    communication_options=worker_util.communication_options(),
    gradient_flow=gf_tf.GradientFlowAllReduce(compression="fp16", algorithm="ring"))
if args.mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")
x, y = worker_util.regression_data(16 * args.steps)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3, dtype="float32")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(np.concatenate([w.ravel() for w in self.model.get_weights()]))


local_sgd = gf_tf.keras.LocalSGD(args.sync_every, outer_optimizer=args.outer)
record = Record()
model.fit(dataset, epochs=1, verbose=0, callbacks=[local_sgd, record])
totals = strategy.gradient_flow.stats.totals()
worker_util.write_result(after_step=np.stack(record.seen), meetings=local_sgd.meetings,
                         evaluate_loss=model.evaluate(dataset, verbose=0),
                         sent_bytes=totals["sent_bytes"], stat_steps=totals["steps"],
                         applied_steps=int(model.optimizer.iterations.numpy()))
print("done", local_sgd.meetings, totals)
