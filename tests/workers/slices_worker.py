"""One worker of a 2-worker job whose gradients include tf.IndexedSlices (gf_tf.slices).

First one all-reduce (MEAN) of this worker's own IndexedSlices (rows_of(rank): 5 rows on
worker 0, 3 on worker 1, each at its own magnitude, TensorFlow's gather pads them) beside a dense
gradient, through gf_tf.all_reduce_gradients; then 3 steps of a Keras fit of an Embedding model
(its gradient is IndexedSlices). --compression fp16, auto or none. Writes the reduced rows, indices,
dense gradient, its own inputs (own_*), the fitted weights (w0, w1, ...) and CommStats' byte
totals.
"""

import argparse

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--compression", default="fp16", choices=["fp16", "auto", "none"])
args = parser.parse_args()

import gf_tf  # after argparse: fail fast on bad flags


def rows_of(rank):
    """(values float32 [n, 4], indices int64 [n], dense float32 [13]) of worker `rank`."""
    rng = np.random.default_rng(100 + rank)
    n = (5, 3)[rank]
    values = rng.normal(size=(n, 4)) * 10.0 ** rng.uniform(-20, 20, size=(n, 1))
    return (values.astype(np.float32), rng.integers(0, 11, n).astype(np.int64),
            rng.normal(size=13).astype(np.float32))


rank = worker_util.task_index()
gradient_flow = gf_tf.GradientFlowAllReduce(
    compression=None if args.compression == "none" else args.compression)
strategy = gf_tf.MultiWorkerMirroredStrategy(
    communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)
values, indices, dense = rows_of(rank)
with tf.init_scope():
    variables = [tf.Variable(tf.zeros([11, 4]), name="table"), tf.Variable(tf.zeros([13]), name="v")]


@tf.function
def step():
    def replica():
        sliced = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                  tf.constant([11, 4], tf.int64))
        return gf_tf.all_reduce_gradients([sliced, tf.identity(tf.constant(dense))], variables,
                                          tf.distribute.ReduceOp.MEAN)
    return strategy.run(replica)


reduced_slices, reduced_dense = (strategy.experimental_local_results(v)[0] for v in step())
assert isinstance(reduced_slices, tf.IndexedSlices), type(reduced_slices)
all_reduce_totals = gradient_flow.stats.totals()

tokens = np.random.default_rng(7).integers(0, 50, size=(32, 6))
labels = tokens.sum(axis=1) % 3
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8).take(3), epochs=1,
          verbose=0)
worker_util.write_result(own_values=values, own_indices=indices, own_dense=dense,
                         values=reduced_slices.values.numpy(),
                         indices=reduced_slices.indices.numpy(), dense=reduced_dense.numpy(),
                         all_reduce_sent_bytes=np.array(all_reduce_totals["sent_bytes"]),
                         **{f"w{i}": w for i, w in enumerate(model.get_weights())})
