"""A worker that finishes late or early, then leaves with or without gf_tf.worker.exit_together.

argv: "barrier" or "no-barrier", then seconds this worker works (sleeps) after the all-reduce.
"""

import sys
import time

import tensorflow as tf

import worker_util
from gf_tf import worker

strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=worker_util.communication_options())
total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
print(f"all-reduced {float(total)}", flush=True)
time.sleep(float(sys.argv[2]))   # e.g. evaluating locally, longer on one worker than on the other
left_together = worker.exit_together(60.0) if sys.argv[1] == "barrier" else None
print(f"leaving at {time.time():.3f} (barrier: {left_together})", flush=True)
