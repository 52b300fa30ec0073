import logging, time
logging.basicConfig(level=logging.INFO)
import tensorflow as tf
import worker_util
from gf_tf import probe, tf_internal
opts = worker_util.communication_options()
s = tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)
ops = tf_internal.cross_device_ops_of(s)
t=time.time()
c = probe.measure(ops, s.extended.worker_devices, opts, 2)
print("COSTS", c, time.time()-t)
worker_util.write_result(c=c.as_list())
