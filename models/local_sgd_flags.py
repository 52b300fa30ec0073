"""models.train's local SGD flags and the `gf_tf.keras.LocalSGD` they build (docs/local-sgd.md).

Defined apart from models/train.py's other flags, parsed with them; no TensorFlow is imported
until `callbacks()` runs.
"""

from absl import flags

flags.DEFINE_integer("sync_every", 0, "local SGD (gf_tf.keras.LocalSGD): steps each replica trains "
                     "alone between meetings; 0 = every step synchronous")
flags.DEFINE_enum("outer", "average", ["average", "nesterov"],
                  "--sync_every: how the replicas meet: average (post-local SGD: the mean of the "
                  "weights) or nesterov (DiLoCo: outer Nesterov SGD on the mean pseudo-gradient)")
flags.DEFINE_float("outer_learning_rate", 0.7, "--outer nesterov: the outer learning rate (DiLoCo: 0.7)")
flags.DEFINE_float("outer_momentum", 0.9, "--outer nesterov: the outer momentum (DiLoCo: 0.9)")
flags.DEFINE_integer("sync_warmup_steps", None, "--sync_every: synchronous steps before the "
                     "first local one (LocalSGD(warmup_steps=); default: LocalSGD's, 50)",
                     lower_bound=0)

NAMES = ("sync_every", "outer", "outer_learning_rate", "outer_momentum", "sync_warmup_steps")
AT_LEAST = {"sync_every": 0}   # models.train checks these ranges with its own


def callbacks() -> list:
    """[gf_tf.keras.LocalSGD] built from the flags (list it before BackupAndRestore), or []
    with --sync_every 0."""
    values = flags.FLAGS
    if values.sync_every == 0:
        return []
    from gf_tf.keras import local_sgd  # pylint: disable=import-outside-toplevel
    outer = local_sgd.outer_optimizer_named(values.outer, values.outer_learning_rate,
                                            values.outer_momentum)
    warmup = {} if values.sync_warmup_steps is None else {"warmup_steps": values.sync_warmup_steps}
    return [local_sgd.LocalSGD(values.sync_every, outer_optimizer=outer, **warmup)]
