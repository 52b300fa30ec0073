"""CSC state in checkpoints and BackupAndRestore: now gf_tf.keras.checkpoint; this name keeps working."""

from gf_tf.keras.checkpoint import (  # noqa: F401
    ATTRIBUTE, FORMAT, BackupAndRestore, GradientFlowCheckpoint, attach, of)
