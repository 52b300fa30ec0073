"""One worker of a 2-worker Keras fit with gf_tf.keras.backup.BackupAndRestore and --reducer: CSC
(--selection) or gf_tf.reducers.LowRank(rank=2) (worker_util.checkpoint_strategy).

--kill_after_epoch k: at the end of epoch k (after the backup callback ran),
worker 1 SIGKILLs itself. Every worker writes its reducer state at the end of epoch k to
--state_dir/epoch<k>_worker<i>.npz: CSC's residuals, velocity and step counter (with
selection="ahead" also the scores and bound); the low-rank reducer's arrays by
`VariablesState.to_arrays` key (p0_q0_r0, p0_residual_r0, ...). A run
started over an existing backup records the state as restored (right when the
variable set's state is created, before the first step) and writes it with the
final weights and the final state (final_<key>) to GF_TF_RESULT.
"""

import argparse
import os
import signal

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--backup_dir", required=True)
parser.add_argument("--state_dir", required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--kill_after_epoch", type=int, default=-1)
parser.add_argument("--steps_per_epoch", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=16)
parser.add_argument("--selection", default="per_pack")
parser.add_argument("--reducer", default="csc", choices=["csc", "csc_auto", "lowrank"])
args = parser.parse_args()

import gf_tf  # after argparse: fail fast on bad flags
from gf_tf.keras import backup as checkpoint

tf.config.experimental.enable_op_determinism()
rank = worker_util.task_index()
gradient_flow, strategy = worker_util.checkpoint_strategy(args.reducer, args.selection)

x, y = worker_util.regression_data(args.global_batch * args.steps_per_epoch)
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")


def snapshot(state):
    if args.reducer == "lowrank":
        return state.to_arrays()
    pack = state.pack_states[0]
    out = {"steps": np.array([int(s.numpy()) for s in pack.steps]),
           "residual": pack.residuals[0].numpy(), "velocity": pack.velocities[0].numpy()}
    if pack.scores:   # selection="ahead": the next step's chunks are chosen from these
        out.update(scores=pack.scores[0].numpy(), bound=pack.bounds[0].numpy())
    if args.reducer == "csc_auto":
        out["regime"] = state.shared.auto.regime.numpy()
    return out


class AtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch != args.kill_after_epoch:
            return
        (state,) = gradient_flow.states().values()
        np.savez(os.path.join(args.state_dir, f"epoch{epoch}_worker{rank}.npz"), **snapshot(state))
        if rank == 1:
            print(f"worker 1: SIGKILL after epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Recorder:
    """Registered after the checkpoint's listener: sees the state as restored."""
    restored = None

    def record(self, state):
        Recorder.restored = snapshot(state)


model.optimizer.build(model.trainable_variables)   # attaches gf_tf.keras.checkpoint's listener first
recorder = Recorder()
gradient_flow.state_registry.add_listener(recorder.record)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)
history = model.fit(dataset, epochs=args.epochs, verbose=0, shuffle=False,
                    callbacks=[checkpoint.BackupAndRestore(args.backup_dir), AtEpochEnd(),
                               gf_tf.GradientFlowStats(gradient_flow)])
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result.update({f"restored_{k}": v for k, v in Recorder.restored.items()})
(final_state,) = gradient_flow.states().values()
result.update({f"final_{k}": v for k, v in snapshot(final_state).items()})
result["epochs_run"] = np.array(history.epoch)
result["selected_chunks"] = np.array(history.history["gf_selected_chunks_per_step"])
result["densities"] = np.array(history.history["gf_density"])
result.update({f"comm_{k}": np.array(v) for k, v in gradient_flow.stats.totals().items()})
worker_util.write_result(**result)
print("done", history.epoch, flush=True)
