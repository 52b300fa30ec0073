"""Keras fit of a linear model (Dense(3), MSE, SGD 0.1) with `steps_per_execution` (Keras 3, or tf-keras under TF_USE_LEGACY_KERAS=1), under
MirroredStrategy(cross_device_ops=GradientFlowAllReduce) on 2 logical CPUs (no TF_CONFIG) or
gf_tf.MultiWorkerMirroredStrategy (TF_CONFIG, one CPU per worker).

Writes the initial and final weights (w0_init, w1_init, w0, w1), the data (x, y), the
optimizer's step count (applied updates; micro_steps: Keras's `_iterations`, the batches seen
under gradient accumulation), the CSC step counter (-1 without CSC) and local replica r's
residual (residual_r{r}: CSC's, the pack's elements in backprop order; the low-rank reducer's,
the kernel's [8, 3] elements) and with --rank the low-rank Q (q_r{r}), the gradient all-reduces
GradientFlow carried (gf_steps), or `error` (the message
of the ValueError fit raised, e.g. for --accumulation).
"""

import argparse
import os

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps_per_execution", type=int, default=1)
parser.add_argument("--compression", default="none")
parser.add_argument("--density", type=float, default=0.0, help="CSC density; 0: dense")
parser.add_argument("--accumulation", type=int, default=0, help="gradient_accumulation_steps")
parser.add_argument("--chunk_size", type=int, default=4, help="CSC chunk size")
parser.add_argument("--warmup_steps", type=int, default=3, help="CSC dense warm-up steps")
parser.add_argument("--momentum", type=float, default=0.9, help="CSC momentum correction")
parser.add_argument("--rank", type=int, default=0,
                    help="gf_tf.reducers.LowRank(rank=...); 0: the default reducer")
parser.add_argument("--stock_all_reduce", action="store_true",
                    help="MirroredStrategy with TF's own cross-device ops (no GradientFlow)")
parser.add_argument("--examples", type=int, default=112)   # 7 global batches of 16
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--unknown_length", action="store_true",
                    help="a dataset of unknown cardinality (Keras learns the epoch's end from the data)")
parser.add_argument("--legacy_optimizer", action="store_true", help="tf-keras's OptimizerV2 SGD")
args = parser.parse_args()

MULTI_WORKER = "TF_CONFIG" in os.environ
if not MULTI_WORKER:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import gf_tf  # pylint: disable=wrong-import-position
import worker_util  # pylint: disable=wrong-import-position
from gf_tf.keras import flavour as keras_flavour  # pylint: disable=wrong-import-position

keras = keras_flavour.keras_module()   # tf-keras under TF_USE_LEGACY_KERAS=1, else Keras 3

sparsity = (gf_tf.ChunkSparsity(density=args.density, chunk_size=args.chunk_size,
                                warmup_steps=args.warmup_steps, momentum=args.momentum)
            if args.density else None)
gradient_flow = gf_tf.GradientFlowAllReduce(
    compression=None if args.compression == "none" else args.compression, sparsity=sparsity,
    reducer=gf_tf.reducers.LowRank(rank=args.rank, warmup_steps=0) if args.rank else None)
if MULTI_WORKER:
    strategy = gf_tf.MultiWorkerMirroredStrategy(
        communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)
else:
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=None if args.stock_all_reduce else gradient_flow)

x, y = worker_util.regression_data(args.examples)
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    sgd = keras.optimizers.legacy.SGD if args.legacy_optimizer else keras.optimizers.SGD
    optimizer = sgd(0.1, **({"gradient_accumulation_steps": args.accumulation} if args.accumulation else {}))
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=args.steps_per_execution)
initial = {f"w{i}_init": w for i, w in enumerate(model.get_weights())}
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
if args.unknown_length:
    dataset = dataset.filter(lambda *batch: True)
try:
    model.fit(dataset, epochs=args.epochs, verbose=0)
except ValueError as e:
    worker_util.write_result(error=str(e))
    raise SystemExit(0)
csc_step, residuals = -1, {}
if sparsity or args.rank:
    (variable_set,) = gradient_flow.states().values()
    pack_state = variable_set.pack_states[0]
    residuals = {f"residual_r{r}": v.numpy() for r, v in enumerate(pack_state.residuals)}
if sparsity:
    csc_step = int(pack_state.step.numpy())
if args.rank:
    residuals.update({f"q_r{r}": v.numpy() for r, v in enumerate(pack_state.qs[0])})
micro_steps = getattr(optimizer, "_iterations", optimizer.iterations).numpy()   # pylint: disable=protected-access
worker_util.write_result(x=x, y=y, iterations=int(optimizer.iterations.numpy()), csc_step=csc_step,
                         micro_steps=int(micro_steps), **residuals,
                         gf_steps=gradient_flow.stats.totals()["steps"],
                         **initial, **{f"w{i}": w for i, w in enumerate(model.get_weights())})
print("done", args)
