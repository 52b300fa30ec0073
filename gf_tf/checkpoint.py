"""CSC state in checkpoints, BackupAndRestore, load_weights_from_chief: now gf_tf.keras.checkpoint
and gf_tf.keras.backup; this name keeps working."""

from gf_tf.keras.backup import BackupAndRestore, load_weights_from_chief  # noqa: F401
from gf_tf.keras.checkpoint import (  # noqa: F401
    ATTRIBUTE, FORMAT, GradientFlowCheckpoint, attach, of)
from gf_tf.keras.checkpoint_checks import CheckpointMismatchError  # noqa: F401
