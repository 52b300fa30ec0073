"""One worker of a multi-worker Keras model.fit with CSC (gf_tf.ChunkSparsity).

Writes its final weights (w0, w1, ...), its CSC residual and step counter, the
per-step communication figures of every step, and the (dtype, element count)
of every CollectiveReduceV2 in the traced step's main graph.

--density auto chooses the density each step from measured timing; with
--fake_clock COMPUTE,COMM this worker's clock measures exactly those seconds
(CSCReducer.clock), so the test knows what each worker feeds into the decision.
"""

import argparse

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--density", default="0.1", help='a fraction, or "auto"')
parser.add_argument("--auto_budget", type=float, default=0.05)
parser.add_argument("--min_density", type=float, default=None, help="default: ChunkSparsity's")
parser.add_argument("--fake_clock", default="", help="COMPUTE,COMM seconds per step (auto)")
parser.add_argument("--chunk_size", type=int, default=16)
parser.add_argument("--warmup_steps", type=int, default=0)
parser.add_argument("--warmup", default="dense")
parser.add_argument("--momentum", type=float, default=0.0)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--selection", default="per_pack")
parser.add_argument("--scoring", default="error_feedback")
parser.add_argument("--global_batch", type=int, default=16)
parser.add_argument("--hidden", type=int, default=32)
args = parser.parse_args()

import gf_tf  # after argparse: fail fast on bad flags

density = args.density if args.density == "auto" else float(args.density)
auto = dict(auto_budget=args.auto_budget) if density == "auto" else {}
if density == "auto" and args.min_density is not None:
    auto["min_density"] = args.min_density
if density == "auto" and args.fake_clock:
    # A fake clock tests the price alone: no critical-regime test, minimum saving or chunk count.
    density = gf_tf.csc.AutoDensity(auto.pop("min_density", gf_tf.csc.DEFAULT_MIN_DENSITY),
                                    auto.pop("auto_budget"), min_saving=0.0, regime_window=0,
                                    min_chunks=1)
sparsity = gf_tf.ChunkSparsity(density=density, chunk_size=args.chunk_size,
                               warmup_steps=args.warmup_steps, warmup=args.warmup,
                               momentum=args.momentum, selection=args.selection,
                               scoring=args.scoring, **auto)
# A fake clock's figures are priced by bytes alone: fixed settings, so no probe measures the
# link's latency (gf_tf.plan.latency_bytes).
fixed = dict(compression="fp16", bytes_per_pack=4 << 20, algorithm="ring") if args.fake_clock else {}
gradient_flow = gf_tf.GradientFlowAllReduce(sparsity=sparsity, **fixed)
strategy = gf_tf.MultiWorkerMirroredStrategy(
    communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)

# After the strategy: a variable would start the TF runtime before it configures collectives.
if args.fake_clock:
    compute, comm = (float(s) for s in args.fake_clock.split(","))
    with tf.device("/cpu:0"):
        clock = tf.Variable(100.0, dtype=tf.float64, trainable=False)
    gradient_flow.reducer.clock = lambda replica, event: clock.assign_add(
        {"ready": compute, "send": 0.0, "done": comm}[event])

x, y = worker_util.regression_data(args.global_batch * args.steps)

with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(args.hidden, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")


class PerStep(keras.callbacks.Callback):
    """Communication figures of every single step (deltas of the running totals)."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self.densities = []
        self.last = None

    def on_train_batch_begin(self, batch, logs=None):
        self.last = gradient_flow.stats.totals()

    def on_train_batch_end(self, batch, logs=None):
        now = gradient_flow.stats.totals()
        self.rows.append([now[k] - self.last[k] for k in
                          ("dense_bytes", "sent_bytes", "selected_chunks", "total_chunks")])
        self.densities.append(now["densities"] - self.last["densities"])


per_step = PerStep()
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)
history = model.fit(dataset, epochs=1, verbose=0,
                    callbacks=[gf_tf.GradientFlowStats(gradient_flow), per_step])

(variable_set,) = gradient_flow.states().values()
(state,) = variable_set.pack_states
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["residual"] = state.residuals[0].numpy()
result["csc_steps"] = int(state.step.numpy())
if state.scores is not None:   # selection="ahead": the next step's choice and scale
    result["scores"] = state.scores[0].numpy()
    result["bound"] = state.bounds[0].numpy()
result["per_step"] = np.array(per_step.rows, np.float64)
result["per_step_density"] = np.array(per_step.densities, np.float64)
result["compression_ratio"] = history.history["gf_compression_ratio"][0]
reduces = worker_util.collective_reduces(model)
result["reduce_dtypes"] = np.array([d for d, _ in reduces], dtype="U16")
result["reduce_elements"] = np.array([-1 if c is None else c for _, c in reduces], np.int64)
result["num_params"] = model.count_params()
worker_util.write_result(**result)
print("done", history.history, reduces)
