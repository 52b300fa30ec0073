"""gf_tf: GradientFlow gradient communication for TensorFlow / Keras.

Public API:
  GradientFlowAllReduce  packed FP16/BF16 (and CSC) all-reduce, a tf.distribute.CrossDeviceOps
  MultiWorkerMirroredStrategy  tf.distribute.MultiWorkerMirroredStrategy with GradientFlow
  ChunkSparsity  coarse-grained sparse communication (CSC) for GradientFlowAllReduce(sparsity=...)
  GradientFlowStats  Keras callback: bytes sent, compression ratio, chunks, residual norm
  all_reduce_gradients  a custom loop's gradient all-reduce, compressed by GradientFlow
  keras    the Keras wing: install() (the fixes for multi-worker fit and the gradient hook),
           keras.checkpoint (CSC state in checkpoints), keras.backup (BackupAndRestore,
           load_weights_from_chief); the core imports no Keras
  ops      pack/unpack, abs_max and the chunk ops (compiled, with a composite-TF fallback)
  wire, collectives, reducers, plan  the registries of wire formats, all-reduce algorithms
           and reducers, and the planner (docs/api/extending.md)
  launch   local multi-worker launcher and TF_CONFIG helpers (gf-tf-run)
  worker   what a worker process of a multi-worker job calls (exit_together)

Names are imported on first use, so `gf-tf-run` (gf_tf.launch) starts without
importing TensorFlow. gf_tf does not install TensorFlow: importing it without one
raises ImportError naming the `cpu` extra. This module wires the Keras wing to
the core: it registers the wing's installer with gf_tf.integrations, which
GradientFlowAllReduce runs when created.
"""

import importlib
import importlib.util
import sys

__version__ = "0.2.0"
SUPPORTED_TENSORFLOW = "2.18-2.21"


def _require_tensorflow() -> None:
    """Raises ImportError, naming how to install one, if no TensorFlow is installed (never imports it)."""
    if importlib.util.find_spec("tensorflow") is None:
        raise ImportError(
            f"gf_tf needs TensorFlow {SUPPORTED_TENSORFLOW}, and none is installed in this Python "
            f"({sys.executable}). gf_tf leaves the choice of TensorFlow build to you: "
            f"install yours (e.g. `pip install tensorflow-cpu==2.21.*` or `tensorflow[and-cuda]`), "
            f"or gf_tf with its `cpu` extra: `pip install 'gf_tf[cpu]'` (`pip install -e '.[cpu]'` "
            f"in a checkout).")


_require_tensorflow()

from gf_tf import integrations  # noqa: E402  (imports nothing, so gf-tf-run stays light)


def _install_keras_wing() -> None:
    """gf_tf.keras.install(), importing the Keras wing only now, and only if a Keras is installed."""
    if importlib.util.find_spec("keras") is None and importlib.util.find_spec("tf_keras") is None:
        return
    importlib.import_module("gf_tf.keras").install()


integrations.register(_install_keras_wing)

_EXPORTS = {
    "GradientFlowAllReduce": "gf_tf.cross_device_ops",
    "MultiWorkerMirroredStrategy": "gf_tf.strategy",
    "ChunkSparsity": "gf_tf.csc",
    "GradientFlowStats": "gf_tf.keras.callbacks",
    "all_reduce_gradients": "gf_tf.gradients",
}
_SUBMODULES = ("collectives", "csc", "keras", "launch", "ops", "plan", "reducers", "wire", "worker")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"gf_tf.{name}")
    else:
        raise AttributeError(f"module 'gf_tf' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
