"""Keras model.fit under tf.distribute.MirroredStrategy(cross_device_ops=GradientFlowAllReduce)
on N logical CPU devices.

One strategy with collectives per process: TF 2.21 numbers the collective
groups and instances of every MirroredStrategy object from the same keys, so a
second strategy with collectives in one process collides with the first
("Collective instance 100 expected ... data_type 19 but got ... 1"). The
float32 reference therefore uses ReductionToOneDevice (no collectives).

Writes: w* (weights after fit), loss, the CollectiveReduceV2 ops of the traced
step, the optimizer class, GradientFlow's byte statistics, plain_w*/plain_loss
(the same fit with TF's float32 ReductionToOneDevice) and the replica-context
gradient all-reduce (no merge_call) results with their NumPy float64 reference.
"""

import argparse

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--bytes_per_pack", type=int, default=1024)
parser.add_argument("--mixed_precision", action="store_true")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--density", type=float, default=0.0, help="> 0: CSC, chunks of 4 elements")
args = parser.parse_args()

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.devices)])

import keras  # pylint: disable=wrong-import-position
import gf_tf  # pylint: disable=wrong-import-position
import worker_util  # pylint: disable=wrong-import-position

DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
if args.mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")

global_batch = 6 * args.devices
rng = np.random.default_rng(0)
n = global_batch * args.steps
x = rng.normal(size=(n, 8)).astype(np.float32)
y = (x @ rng.normal(size=(8, 3)) + 0.1 * rng.normal(size=(n, 3))).astype(np.float32)


def fit(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(3, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    history = model.fit(dataset, epochs=1, verbose=0)
    return model, history.history["loss"]


sparsity = gf_tf.ChunkSparsity(density=args.density, chunk_size=4) if args.density else None
gfar = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=args.bytes_per_pack,
                                   sparsity=sparsity)   # one worker's "auto" would be TF's own
strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=gfar)
model, loss = fit(strategy)
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["loss"] = np.array(loss)
reduces = worker_util.collective_reduces(model)
result["reduce_dtypes"] = np.array([d for d, _ in reduces], dtype="U16")
result["reduce_elements"] = np.array([c for _, c in reduces], np.int64)
result["optimizer"] = np.array(type(model.optimizer).__name__)
stats = gfar.stats.result()
result["sent_bytes_per_step"] = stats["sent_bytes_per_step"]
result["dense_bytes_per_step"] = stats["dense_bytes_per_step"]
result["retries_per_step"] = stats.get("float32_retries_per_step", 0.0)

plain_model, plain_loss = fit(tf.distribute.MirroredStrategy(
    DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()))
result.update({f"plain_w{i}": w for i, w in enumerate(plain_model.get_weights())})
result["plain_loss"] = np.array(plain_loss)

# The replica-context path (no merge_call), run the way MirroredStrategy runs it under
# XLA on all-GPU devices: _use_merge_call() is False, so every replica all-reduces its own
# gradients through the strategy's CollectiveAllReduce, inside one traced function.
a = rng.normal(size=(args.devices, 7)).astype(np.float32) * 100
b = rng.integers(-5, 5, size=(args.devices, 2)).astype(np.int32)
c = rng.normal(size=(args.devices, 3)).astype(np.float64)
replica_variables = [tf.Variable(0.0, name=name) for name in ("a", "b", "c", "none")]
strategy.extended._use_merge_call = lambda: False  # pylint: disable=protected-access
stats_before = gfar.stats.totals()


@tf.function
def replica_path():
    def fn():
        ctx = tf.distribute.get_replica_context()
        r = tf.get_static_value(ctx.replica_id_in_sync_group)
        values = [tf.identity(a[r]), tf.identity(b[r]), tf.identity(c[r]), None]
        return gf_tf.all_reduce_gradients(
            values, replica_variables,
            options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=30))
    return strategy.run(fn)


out = replica_path()
for i, key in enumerate(("a", "b", "c")):
    result[f"replica_{key}"] = np.stack([v.numpy() for v in strategy.experimental_local_results(out[i])])
    result[f"replica_{key}_ref"] = np.sum({"a": a, "b": b, "c": c}[key].astype(np.float64), axis=0)
result["replica_none_is_none"] = np.array(out[3] is None)
result["replica_a_inputs"] = a
result["replica_stat_steps"] = gfar.stats.totals()["steps"] - stats_before["steps"]
worker_util.write_result(**result)
print("done", loss, reduces)
