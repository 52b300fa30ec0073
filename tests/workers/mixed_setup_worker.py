"""One worker of a job whose workers differ: argv[1 + index] is this worker's setup,
"gradient_flow" (gf_tf.MultiWorkerMirroredStrategy, its defaults) or "plain" (TensorFlow's
MultiWorkerMirroredStrategy with only gf_tf's Keras fixes). Writes the error it ended with
(type name, text, gf_tf.worker.lost_worker_message's line) or "" if fit finished."""

import sys

import numpy as np
import tensorflow as tf
import keras

import worker_util
import gf_tf
from gf_tf import worker

setup = sys.argv[1 + worker_util.task_index()]
error = line = kind = ""
try:
    if setup == "gradient_flow":
        strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=worker_util.communication_options())
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=worker_util.communication_options())
        gf_tf.keras.install()
    x, y = worker_util.regression_data(64)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
except Exception as e:  # pylint: disable=broad-except
    kind, error, line = type(e).__name__, str(e), worker.lost_worker_message(e) or ""
worker_util.write_result(kind=np.array(kind), error=np.array(error), line=np.array(line))
print(f"ended: {kind}: {line or error[:300]}", flush=True)
