"""gf_tf's Keras wing: every module that knows Keras (the core, gf_tf/*.py, imports none of them).

  flavour     which Keras runs (Keras 3 or tf-keras) and the versions gf_tf was tested with
  patches     the one table of private Keras names gf_tf touches; install() applies them
  trainer_patches, optimizer_patches  the wrappers that table installs (fit and the step loop;
              gradients, loss scaling, accumulation, checkpoints)
  multi_step  Keras's step loop rebuilt so no step is counted past the data's end (trainer_patches uses it)
  checkpoint  any reducer's state in Keras checkpoints (checkpoint_checks: does it fit this run?;
              checkpoint_format: its bytes)
  backup      restoring every worker from the chief's files: BackupAndRestore, load_weights_from_chief,
              the other workers' side files
  callbacks   GradientFlowStats, the Keras callback of a GradientFlowAllReduce's CommStats
  local_sgd   LocalSGD (gf_tf.keras.LocalSGD): local SGD and DiLoCo in model.fit (Keras 3)

gf_tf/__init__.py registers `install` with gf_tf.integrations, which GradientFlowAllReduce runs.
"""

from gf_tf.keras.patches import install  # noqa: F401


def __getattr__(name):
    if name == "LocalSGD":   # imported on first use: it needs Keras 3, the wing's other modules do not
        from gf_tf.keras.local_sgd import LocalSGD  # pylint: disable=import-outside-toplevel
        return LocalSGD
    raise AttributeError(f"module 'gf_tf.keras' has no attribute {name!r}")
