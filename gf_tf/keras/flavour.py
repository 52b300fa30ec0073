"""Which Keras runs, and the versions gf_tf was tested with (docs/compatibility.md).

Two Keras flavours are supported:
- Keras 3 (`keras`, the minors of TESTED_KERAS_VERSIONS), the Keras `tf.keras` is by default;
- tf-keras (`tf_keras`, Keras 2, selected by TF_USE_LEGACY_KERAS=1 as TensorFlow
  selects it for `tf.keras`), of the same minor version as TensorFlow.
"""

import importlib
import os
from typing import FrozenSet, Tuple

import tensorflow as tf

TESTED_KERAS_VERSIONS = ("3.6", "3.7", "3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14", "3.15")   # Keras 3: the noxfile cells that passed
TESTED_TF_KERAS_VERSIONS = ("2.18", "2.19", "2.20", "2.21")  # tf-keras, same minor as TensorFlow
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
# A noxfile cell `tfX.Y-keras3.N` sets this to "3.N": the cell tests that minor before it is listed.
KERAS_UNDER_TEST_ENV = "GF_TF_KERAS_UNDER_TEST"
KERAS3 = "keras"
TF_KERAS = "tf-keras"


def uses_tf_keras() -> bool:
    """True if `tf.keras` is tf-keras here: TF_USE_LEGACY_KERAS is 1/true, TensorFlow's own rule."""
    return os.environ.get(LEGACY_KERAS_ENV, "") in ("1", "true", "True")


def keras_module():
    """The Keras package `tf.keras` stands for: `tf_keras` (tf-keras) or `keras` (Keras 3)."""
    return importlib.import_module("tf_keras" if uses_tf_keras() else "keras")


def flavour() -> str:
    """"tf-keras" or "keras" (Keras 3): the Keras that models built with `tf.keras` use."""
    return TF_KERAS if uses_tf_keras() else KERAS3


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def minor_number(version: str) -> Tuple[int, int]:
    """(major, minor) of a version: (3, 7) for "3.7" or "3.7.1"."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def keras3_minor() -> Tuple[int, int]:
    """(3, N) of the installed Keras 3, the one the Keras 3 patches wrap (also in a tf-keras process)."""
    return minor_number(importlib.import_module("keras").__version__)


def check_keras_version(version: str = None, tf_keras: bool = None) -> None:
    """Raises RuntimeError unless the running Keras flavour and version were tested with gf_tf.

    Keras 3: TESTED_KERAS_VERSIONS, and the minor $GF_TF_KERAS_UNDER_TEST names (a noxfile
    cell's, so the cell can test a minor not listed yet). tf-keras: TESTED_TF_KERAS_VERSIONS,
    and the same minor version as TensorFlow (tf-keras X.Y is built for TensorFlow X.Y).
    """
    tf_keras = uses_tf_keras() if tf_keras is None else tf_keras
    if tf_keras:
        version = version or keras_module().__version__
        if _minor(version) not in TESTED_TF_KERAS_VERSIONS or _minor(version) != _minor(tf.__version__):
            raise RuntimeError(
                f"gf_tf was tested with tf-keras {', '.join(TESTED_TF_KERAS_VERSIONS)} "
                f"(TF_USE_LEGACY_KERAS=1), each with the TensorFlow of the same minor version; found "
                f"tf-keras {version} with TensorFlow {tf.__version__}. Install "
                f"tf-keras=={_minor(tf.__version__)}.* (or unset TF_USE_LEGACY_KERAS for Keras 3).")
        return
    version = version or keras_module().__version__
    if _minor(version) not in TESTED_KERAS_VERSIONS + (os.environ.get(KERAS_UNDER_TEST_ENV),):
        raise RuntimeError(
            f"gf_tf patches Keras's TensorFlow trainer for multi-worker fit "
            f"(keras-team/keras#20585) and was tested with Keras "
            f"{', '.join(TESTED_KERAS_VERSIONS)} only; found Keras {version}. "
            f"Install keras=={TESTED_KERAS_VERSIONS[-1]}.* or port gf_tf/keras/patches.py.")


def callback_base():
    """The Callback class of the running Keras flavour (GradientFlowStats derives from it)."""
    return keras_module().callbacks.Callback


def patched_flavours() -> FrozenSet[str]:
    """The flavours whose patches this process needs, after `check_keras_version` of the running one.

    The running flavour; and Keras 3 next to tf-keras when a tested Keras 3 is installed there
    (Keras 3 models, `import keras`, may also run in a tf-keras process). Raises RuntimeError
    on an untested running Keras.
    """
    check_keras_version()
    if not uses_tf_keras():
        return frozenset({KERAS3})
    return frozenset({TF_KERAS, KERAS3}) if _tested_keras3_present() else frozenset({TF_KERAS})


def _tested_keras3_present() -> bool:
    try:
        check_keras_version(importlib.import_module("keras").__version__, tf_keras=False)
    except (ImportError, RuntimeError):
        return False
    return True
