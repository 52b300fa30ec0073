"""One worker of a 2-worker job that follows TF's multi-worker guide: only the chief saves, every
worker loads the chief's file (gf_tf.keras.backup.load_weights_from_chief), then trains on.

After one epoch of CSC, the chief writes --dir/chief.weights.h5 (the other worker waits for it).
Each worker then builds a fresh model and tries plain `model.load_weights` (recorded: the error
message, if any), loads with `load_weights_from_chief` (recorded: gf_tf's warnings and the CSC
state as restored, right when the variable set's state is created) and fits one more epoch.
"""

import argparse
import logging
import os
import time

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
args = parser.parse_args()

import gf_tf  # after argparse: fail fast on bad flags
from gf_tf.keras import backup as checkpoint

tf.config.experimental.enable_op_determinism()
rank = worker_util.task_index()
gradient_flow, strategy = worker_util.checkpoint_strategy()
x, y = worker_util.regression_data(16 * 4)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def build(seed):
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


first = build(1)
first.fit(dataset, epochs=1, verbose=0, shuffle=False)
(first_set,) = gradient_flow.state_registry.all_states()
first_residual, first_steps = first_set.pack_states[0].residuals[0].numpy(), first_set.pack_states[0].steps
path = os.path.join(args.dir, "chief.weights.h5")
if rank == 0:
    first.save_weights(path + ".tmp.weights.h5")
    os.rename(path + ".tmp.weights.h5", path)
while not os.path.exists(path):
    time.sleep(0.1)

restored, new_sets = {}, []


class Recorder:
    """Registered after the checkpoint's listener: sees the state as restored."""

    def record(self, state):
        new_sets.append(state)
        pack = state.pack_states[0]
        restored.update(steps=np.array([int(s.numpy()) for s in pack.steps]),
                        residual=pack.residuals[0].numpy(), velocity=pack.velocities[0].numpy())


second = build(2)
second.optimizer.build(second.trainable_variables)
plain_error = ""
try:
    second.load_weights(path)
except ValueError as e:
    plain_error = str(e)
warnings = []
handler = logging.Handler()
handler.emit = lambda record_: warnings.append(record_.getMessage())
logging.getLogger("gf_tf.keras").addHandler(handler)
checkpoint.load_weights_from_chief(second, path)
loaded = second.get_weights()
recorder = Recorder()
gradient_flow.state_registry.add_listener(recorder.record)
second.fit(dataset, epochs=1, verbose=0, shuffle=False)
(state,) = new_sets
worker_util.write_result(
    plain_error=np.array(plain_error), warnings=np.array("\n".join(warnings)),
    **{f"saved{i}": w for i, w in enumerate(first.get_weights())},
    **{f"loaded{i}": w for i, w in enumerate(loaded)},
    **{f"final{i}": w for i, w in enumerate(second.get_weights())},
    **{f"restored_{k}": v for k, v in restored.items()},
    first_residual=first_residual, first_steps=np.array([int(s.numpy()) for s in first_steps]),
    final_steps=np.array([int(s.numpy()) for s in state.pack_states[0].steps]))
print("done", flush=True)
