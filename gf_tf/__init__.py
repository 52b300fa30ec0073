"""gf_tf: GradientFlow gradient communication for TensorFlow / Keras.

Public API:
  GradientFlowAllReduce  packed FP16/BF16 (and CSC) all-reduce, a tf.distribute.CrossDeviceOps
  MultiWorkerMirroredStrategy  tf.distribute.MultiWorkerMirroredStrategy with GradientFlow
  ChunkSparsity  coarse-grained sparse communication (CSC) for GradientFlowAllReduce(sparsity=...)
  GradientFlowStats  Keras callback: bytes sent, compression ratio, chunks, residual norm
  ops      pack/unpack and the chunk ops (compiled, with a composite-TF fallback)
  launch   local multi-worker launcher and TF_CONFIG helpers (gf-tf-run)
"""

from gf_tf import launch, ops
from gf_tf.cross_device_ops import GradientFlowAllReduce
from gf_tf.strategy import MultiWorkerMirroredStrategy
from gf_tf.sparsity import ChunkSparsity
from gf_tf.stats import GradientFlowStats

__all__ = ["ChunkSparsity", "GradientFlowAllReduce", "GradientFlowStats",
           "MultiWorkerMirroredStrategy", "launch", "ops"]
