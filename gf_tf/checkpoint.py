"""Deprecated: gf_tf.checkpoint moved to gf_tf.keras.checkpoint and gf_tf.keras.backup; this name keeps working with a DeprecationWarning."""

import warnings

from gf_tf.keras.backup import BackupAndRestore, load_weights_from_chief  # noqa: F401
from gf_tf.keras.checkpoint import (  # noqa: F401
    ATTRIBUTE, FORMAT, GradientFlowCheckpoint, attach, of)
from gf_tf.keras.checkpoint_checks import CheckpointMismatchError  # noqa: F401

warnings.warn("gf_tf.checkpoint is deprecated: import from gf_tf.keras.checkpoint and gf_tf.keras.backup", DeprecationWarning, stacklevel=2)
