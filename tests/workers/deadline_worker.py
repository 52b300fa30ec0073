"""A worker that trains a tiny model for many short steps under a collective timeout.

argv: mode, then arguments of the mode.
  threads STEPS DENSITY: `model.fit` for STEPS steps of one epoch under
    gf_tf.MultiWorkerMirroredStrategy (CommunicationOptions(timeout_seconds=GF_TF_COMM_TIMEOUT)),
    GradientFlowAllReduce(compression="fp16", sparsity=ChunkSparsity(DENSITY)) (DENSITY 1: no
    sparsity); this process's thread count (/proc/self/status) is sampled every 50 steps.
    Writes the samples (threads) and the final weights.
  stuck STOP_AT: like threads, but worker 1 stops stepping at batch STOP_AT (it sleeps, alive,
    heartbeats going) for longer than the timeout; worker 0 prints how many seconds after its
    last finished step its fit raised, and the error's type and message.
"""

import sys
import time

import numpy as np
import tensorflow as tf

import worker_util
import gf_tf

mode = sys.argv[1]
strategy = gf_tf.MultiWorkerMirroredStrategy(
    communication_options=worker_util.communication_options(),
    gradient_flow=gf_tf.GradientFlowAllReduce(
        compression="fp16", bytes_per_pack=0,
        sparsity=(gf_tf.ChunkSparsity(float(sys.argv[3]), chunk_size=64, warmup_steps=5)
                  if mode == "threads" and float(sys.argv[3]) < 1 else None)))

import keras  # noqa: E402  (after the strategy, as TF's multi-worker guide asks)


def threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


class Sample(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.samples, self.last_end = [], None

    def on_train_batch_end(self, batch, logs=None):
        self.last_end = time.monotonic()
        if batch % 50 == 0:
            self.samples.append(threads())


class StopStepping(keras.callbacks.Callback):
    def __init__(self, at: int, seconds: float):
        super().__init__()
        self.at, self.seconds = at, seconds

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            print(f"worker {worker_util.task_index()} stops stepping at batch {batch}", flush=True)
            time.sleep(self.seconds)


steps = int(sys.argv[2]) if mode == "threads" else 10_000
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
y = rng.integers(0, 3, size=64)
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
sample = Sample()
callbacks = [sample]
if mode == "stuck" and worker_util.task_index() == 1:
    callbacks.append(StopStepping(int(sys.argv[2]), 3 * worker_util.comm_timeout()))
print(f"threads before fit: {threads()}", flush=True)
try:
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
except tf.errors.OpError as e:
    said = [line for line in e.message.splitlines() if "timed out" in line]
    print(f"fit raised {type(e).__name__} {time.monotonic() - sample.last_end:.1f} s after the "
          f"last finished step: {(said or e.message.splitlines())[0]}", flush=True)
    sys.exit(3)
print(f"threads after fit: {threads()}, max sampled {max(sample.samples)}", flush=True)
worker_util.write_result(threads=np.array(sample.samples),
                         weights=np.concatenate([w.ravel() for w in model.get_weights()]))
