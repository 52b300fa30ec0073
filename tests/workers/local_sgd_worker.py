"""One worker of a 2-worker Keras model.fit with gf_tf.keras.LocalSGD (tests/test_local_sgd_multiworker.py).

Writes its weights after every batch (`after_step`: [steps, elements], flattened), the final
weights (w0, w1, ...), the outer optimizer's variables (outer0, ...), the inner optimizer's float
variables (inner0, ...; SGD's --momentum, this worker's own between meetings), the evaluate loss after
fit, the LocalSGD meetings and GradientFlow's byte totals. With --backup_dir the fit resumes
from gf_tf.keras.backup.BackupAndRestore; --kill_after_epoch k: worker 1 SIGKILLs itself at the
end of epoch k, after the backup.
"""

import argparse
import os
import signal

import numpy as np
import tensorflow as tf
import keras

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--sync_every", type=int, default=3)
parser.add_argument("--outer", default="nesterov")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--mixed_precision", action="store_true")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--momentum", type=float, default=0.0)
parser.add_argument("--backup_dir", default="")
parser.add_argument("--kill_after_epoch", type=int, default=-1)
args = parser.parse_args()

import gf_tf  # noqa: E402  pylint: disable=wrong-import-position
from gf_tf.keras import backup  # noqa: E402  pylint: disable=wrong-import-position

tf.config.experimental.enable_op_determinism()

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
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=args.momentum), loss="mse")


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(np.concatenate([w.ravel() for w in self.model.get_weights()]))


class KillAfterEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == args.kill_after_epoch and worker_util.task_index() == 1:
            print(f"worker 1: SIGKILL after epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


local_sgd = gf_tf.keras.LocalSGD(args.sync_every, outer_optimizer=args.outer, warmup_steps=0)
record = Record()
callbacks = [local_sgd, record]   # LocalSGD first: BackupAndRestore's restore reaches its outer state
if args.backup_dir:
    callbacks += [backup.BackupAndRestore(args.backup_dir), KillAfterEpoch()]
model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
totals = strategy.gradient_flow.stats.totals()
worker_util.write_result(**{f"w{i}": w for i, w in enumerate(model.get_weights())},
                         **{f"outer{i}": v.numpy() for i, v in
                            enumerate(local_sgd.outer_optimizer.variables)},
                         **{f"inner{i}": v.numpy() for i, v in enumerate(model.optimizer.variables)
                            if tf.as_dtype(v.dtype).is_floating},
                         after_step=np.stack(record.seen), meetings=local_sgd.meetings,
                         evaluate_loss=model.evaluate(dataset, verbose=0),
                         sent_bytes=totals["sent_bytes"], stat_steps=totals["steps"],
                         retries=totals.get("figure_float32_retries", 0.0),
                         applied_steps=int(model.optimizer.iterations.numpy()))
print("done", local_sgd.meetings, totals)
