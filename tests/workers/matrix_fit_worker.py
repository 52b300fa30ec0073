"""One worker of the matrix's 2-worker fit: `tf.keras` (Keras 3, or tf-keras under
TF_USE_LEGACY_KERAS=1) on scikit-learn's digits, GradientFlow FP16 + CSC after a dense warm-up.

Writes its final weights (w0, w1, ...), its test accuracy, the epoch logs of
GradientFlowStats and the Keras flavour that ran.
"""

import argparse

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=64)
parser.add_argument("--steps_per_execution", type=int, default=1)
args = parser.parse_args()

import gf_tf  # after argparse: fail fast on bad flags
from gf_tf.keras import flavour as keras_flavour

gradient_flow = gf_tf.GradientFlowAllReduce(
    compression="fp16",
    sparsity=gf_tf.ChunkSparsity(density=0.1, chunk_size=64, warmup_steps=10, momentum=0.9))
strategy = gf_tf.MultiWorkerMirroredStrategy(
    communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)
keras = tf.keras   # the flavour under test: tf_keras when TF_USE_LEGACY_KERAS=1


def digits():
    """(x_train, y_train, x_test, y_test): 8x8 digits scaled to [0, 1], seeded split, same on every worker."""
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1440], y[:1440], x[1440:], y[1440:]


x_train, y_train, x_test, y_test = digits()
with strategy.scope():
    tf.random.set_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=args.steps_per_execution)
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(args.global_batch)
history = model.fit(dataset, epochs=args.epochs, verbose=0,
                    callbacks=[gf_tf.GradientFlowStats(gradient_flow)])
# Local evaluation (a direct call, no collectives): every worker scores the whole test set.
accuracy = float(np.mean(np.argmax(model(x_test, training=False).numpy(), axis=1) == y_test))
worker_util.write_result(
    accuracy=accuracy, flavour=keras_flavour.flavour(), keras_version=keras_flavour.keras_module().__version__,
    compression_ratio=np.array(history.history["gf_compression_ratio"], np.float64),
    loss=np.array(history.history["loss"], np.float64),
    **{f"w{i}": w for i, w in enumerate(model.get_weights())})
print("done", keras_flavour.flavour(), accuracy, history.history)
