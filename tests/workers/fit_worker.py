"""One worker of a multi-worker Keras model.fit with gf_tf.MultiWorkerMirroredStrategy.

Writes its final weights (w0, w1, ...), the losses, the CollectiveReduceV2 ops of
the traced step (dtype code 1 = float16, element counts) and GradientFlow's byte
statistics. With --baseline it runs the same fit in one process without a
strategy (the float32 reference).
"""

import argparse
import json
import os

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--compression", default="fp16", help="fp16, bf16 or none")
parser.add_argument("--gradient_flow", default="on", choices=["on", "off"])
parser.add_argument("--reducer", default="dense", choices=["dense", "lowrank"],
                    help="the default reducer, or gf_tf.reducers.LowRank(rank=--rank, "
                         "warmup_steps=--warmup_steps)")
parser.add_argument("--rank", type=int, default=2)
parser.add_argument("--warmup_steps", type=int, default=0)
parser.add_argument("--bytes_per_pack", type=int, default=1024)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=16)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--mixed_precision", action="store_true")
parser.add_argument("--steps_per_execution", type=int, default=1)
parser.add_argument("--baseline", action="store_true", help="one process, no strategy")
parser.add_argument("--freeze_first_layer", action="store_true",
                    help="same variables, fewer gradients (a variable-list mismatch)")
parser.add_argument("--check_steps_per_execution", action="store_true",
                    help="after fit, record the error of a fit with steps_per_execution=2 ('' if none)")
parser.add_argument("--inf_on_worker", type=int, default=-1,
                    help="this worker alone gets inf inputs in the global batch of --inf_step")
parser.add_argument("--inf_step", type=int, default=1)
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position

if args.mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")

strategy = None
if not args.baseline:
    gradient_flow = None
    if args.gradient_flow == "on":
        gradient_flow = gf_tf.GradientFlowAllReduce(
            compression=None if args.compression == "none" else args.compression,
            bytes_per_pack=args.bytes_per_pack,
            reducer=(gf_tf.reducers.LowRank(rank=args.rank, warmup_steps=args.warmup_steps)
                     if args.reducer == "lowrank" else None))
    strategy = gf_tf.MultiWorkerMirroredStrategy(
        communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)

x, y = worker_util.regression_data(args.global_batch * args.steps)
if args.inf_on_worker == json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index"):
    x[args.inf_step * args.global_batch:(args.inf_step + 1) * args.global_batch] = np.inf


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(args.hidden, activation="tanh"),
                              keras.layers.Dense(3, dtype="float32")])
    model.layers[0].trainable = not args.freeze_first_layer
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  steps_per_execution=args.steps_per_execution)
    return model


if strategy is None:
    model = build()
else:
    with strategy.scope():
        model = build()

dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)
history = model.fit(dataset, epochs=1, verbose=0)

result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["evaluate_loss"] = np.array(model.evaluate(dataset, verbose=0), np.float64)
result["predict"] = model.predict(tf.data.Dataset.from_tensor_slices(x[:32]).batch(8), verbose=0)
result["loss"] = np.array(history.history["loss"], np.float64)
reduces = worker_util.collective_reduces(model) if strategy is not None else []
result["reduce_dtypes"] = np.array([d for d, _ in reduces], dtype="U16")
result["reduce_elements"] = np.array([c for _, c in reduces], np.int64)
if strategy is not None and strategy.gradient_flow is not None:
    stats = strategy.gradient_flow.stats.result()
    result["sent_bytes_per_step"] = stats["sent_bytes_per_step"]
    result["dense_bytes_per_step"] = stats["dense_bytes_per_step"]
    result["stat_steps"] = stats["steps"]
    result["retries_per_step"] = stats.get("float32_retries_per_step", 0.0)
result["optimizer"] = np.array(type(model.optimizer).__name__)
if hasattr(model.optimizer, "dynamic_scale"):
    result["loss_scale"] = np.array(float(model.optimizer.dynamic_scale.numpy()))
    result["applied_steps"] = np.array(int(model.optimizer.iterations.numpy()))
if args.check_steps_per_execution:
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    try:
        model.fit(dataset, epochs=1, verbose=0)
        result["steps_per_execution_error"] = np.array("")
    except ValueError as e:
        result["steps_per_execution_error"] = np.array(str(e))
worker_util.write_result(**result)
print("done", result["loss"], reduces)
