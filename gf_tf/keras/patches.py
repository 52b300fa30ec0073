"""Every private Keras name gf_tf touches, in one table, installed by one function.

`PATCHES` lists the Keras functions gf_tf wraps: target module, attribute, the
Keras flavours it applies to (gf_tf.keras.flavour), the Keras 3 minors (`since`,
`before`) and the reason. Each wrapper delegates to Keras's own code outside the
case it fixes; the wrappers' bodies are in trainer_patches.py (fit and the step
loop) and optimizer_patches.py (gradients, loss scaling, accumulation, checkpoints).
`install()` applies those the running Keras needs, once. `OVERRIDES` lists the
private Keras names that gf_tf's own subclasses define or derive from
(gf_tf/keras/checkpoint.py, backup.py).

Keras 3 (`keras`, the minors of flavour.TESTED_KERAS_VERSIONS; the table follows the private code of
3.6-3.15, and `since`/`before` mark a patch for the minors it applies to):
its TensorFlow trainer fails under
`tf.distribute.MultiWorkerMirroredStrategy` (public report keras-team/keras#20585):
  1. `TensorFlowTrainer._maybe_symbolic_build` calls
     `strategy.reduce("MEAN", <tuple of PerReplica>)` on a data batch:
     "Attempt to convert a value (PerReplica:{...}) to a Tensor". The build only
     needs the batch's structure and shapes, so we hand it local replica 0's batch.
  2. `trainer.reduce_per_replica` reduces the (scalar) logs with
     `strategy.reduce("MEAN", v, axis=0)`: "Invalid reduction dimension 0 for input
     with 0 dimensions". For scalars we reduce with axis=None (the mean over
     replicas); other values keep Keras's behaviour.
  3. `steps_per_execution > 1` fails under Mirrored strategies ("You must feed a value for
     placeholder tensor 'while/.../Placeholder_1'"; stock TF too): Keras 3.7 on call the one-step
     tf.function in a `tf.cond`; we inline it (`trainer_patches._TensorFlowInliningOneStep`).
     Keras 3.6's loop and 3.7 on's single step count a step past the data's end:
     gf_tf.keras.multi_step rebuilds them.
  4. `gradient_accumulation_steps > 1` fails under those strategies ("`merge_call` called
     while defining a new graph"): the all-reduce sits in a `tf.cond`. Under a
     GradientFlowAllReduce, `BaseOptimizer._backend_apply_gradients` takes that cond in
     cross-replica context instead (`optimizer_patches.patched_backend_apply_gradients`) and it
     trains; elsewhere we raise a clear ValueError at fit time (Keras 3.6: from
     `make_train_function`).
  Patches 1-2 are active only for a MultiWorkerMirroredStrategy in multi-worker
  mode, 3-4 for MirroredStrategy and MultiWorkerMirroredStrategy.
tf-keras (`tf_keras`, Keras 2): its multi-worker `fit` needs none of these fixes; its one step
(steps_per_execution=1) counts a step past the data's end as Keras 3's does, and
gf_tf.keras.multi_step guards it under Mirrored strategies (`Model.make_train_function`).

Gradients reach GradientFlow through one hook per flavour, each calling
`gf_tf.all_reduce_gradients` when the strategy's cross-device ops are a
GradientFlowAllReduce, and Keras's own code otherwise:
- Keras 3: `TFOptimizer._all_reduce_sum_gradients`, the optimizer's one gradient all-reduce;
- tf-keras: `Optimizer.aggregate_gradients` and `OptimizerV2._aggregate_gradients`, which
  otherwise call `optimizer_utils.all_reduce_sum_gradients` (`all_reduce(SUM)` or
  `batch_reduce_to(SUM, grads_and_vars)`); its LossScaleOptimizers delegate to them.
Three more Keras 3 patches: `TFOptimizer.build` (reducer state in the optimizer's checkpoint,
gf_tf.keras.checkpoint.attach), `saving_lib._raise_loading_failure` (a reducer state mismatch
is explained first) and `LossScaleOptimizer._tf_apply` (replicas skip non-finite steps together).
"""

import dataclasses
import importlib
from typing import Callable, Tuple

from gf_tf.keras import optimizer_patches as optimizer
from gf_tf.keras import trainer_patches as trainer
from gf_tf.keras.flavour import (  # noqa: F401  (keras3_minor: the Keras 3 minor the patches wrap)
    KERAS3, TF_KERAS, keras3_minor, minor_number, patched_flavours)
from gf_tf.keras.trainer_patches import in_multi_worker_mode  # noqa: F401  (re-exported)

_MARK = "_gf_tf_patch"   # set on each installed wrapper: install() is idempotent


@dataclasses.dataclass(frozen=True)
class Patch:
    """`module`.`attribute` ("Class.method", or a module's function) replaced by `wrap(original)`."""
    module: str
    attribute: str
    flavours: Tuple[str, ...]           # gf_tf.keras.flavour.KERAS3 / TF_KERAS
    wrap: Callable[[Callable], Callable]
    reason: str
    since: str = None                   # Keras 3 patches: the first minor ("3.7") it applies to
    before: str = None                  # and the first minor it no longer applies to


@dataclasses.dataclass(frozen=True)
class Override:
    """A private Keras name that a gf_tf class defines or derives from (not patched in place)."""
    module: str
    attribute: str
    by: str        # the gf_tf class that overrides it
    reason: str


def install() -> None:
    """Installs every patch of PATCHES the running Keras needs, once (idempotent).

    Called through gf_tf.integrations by GradientFlowAllReduce (so before Keras traces
    a step with it) and by gf_tf.MultiWorkerMirroredStrategy (the fit fixes serve it
    without GradientFlow too). The running flavour's patches; Keras 3 models (`import
    keras`) may also run in a tf-keras process, so a tested Keras 3 is patched there too.

    Raises:
      RuntimeError: the running Keras is not a version gf_tf was tested with.
    """
    flavours = patched_flavours()
    for patch in PATCHES:
        if flavours.intersection(patch.flavours) and applies_to_running_keras(patch):
            _apply(patch)


def applies_to_running_keras(patch: Patch) -> bool:
    """False for a Keras 3 patch whose `since`/`before` range excludes the installed Keras 3."""
    if patch.since is None and patch.before is None:
        return True
    running = keras3_minor()
    return ((patch.since is None or running >= minor_number(patch.since))
            and (patch.before is None or running < minor_number(patch.before)))


def _apply(patch: Patch) -> None:
    owner = importlib.import_module(patch.module)
    *path, name = patch.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    replacement = patch.wrap(original)
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)


def _accumulation_patch_applies() -> bool:
    """True if the running Keras is within _ACCUMULATION_PATCH's range: where gradient accumulation
    trains under a GradientFlowAllReduce. Its wrapper and the fit-time refusal ask the table."""
    return applies_to_running_keras(_ACCUMULATION_PATCH)


def _asking_about_accumulation(make_wrapper):
    """`make_wrapper(original, accumulation_patch_applies)` as a `Patch.wrap`."""
    def wrap(original):
        return make_wrapper(original, _accumulation_patch_applies)
    return wrap


_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"
_ISSUE_20585 = "keras-team/keras#20585: Keras 3 multi-worker fit"

_ACCUMULATION_PATCH = Patch(
    "keras.src.optimizers.base_optimizer", "BaseOptimizer._backend_apply_gradients", (KERAS3,),
    _asking_about_accumulation(optimizer.patched_backend_apply_gradients),
    "gradient_accumulation_steps > 1 under a GradientFlowAllReduce: the apply-or-accumulate cond "
    "taken in cross-replica context (one merge_call before it, call_for_each_replica in each "
    "branch); accumulated local gradients are all-reduced once per applied update")

PATCHES = (
    Patch(_TRAINER, "TensorFlowTrainer._maybe_symbolic_build", (KERAS3,), trainer.patched_symbolic_build,
          f"{_ISSUE_20585}: strategy.reduce on a batch of PerReplica; build from replica 0's batch"),
    Patch(_TRAINER, "reduce_per_replica", (KERAS3,), trainer.patched_reduce_per_replica,
          f"{_ISSUE_20585}: scalar logs reduced with axis=0; reduce them with axis=None"),
    Patch(_TRAINER, "TensorFlowTrainer._make_function", (KERAS3,),
          _asking_about_accumulation(trainer.patched_make_function),
          "steps_per_execution > 1 under Mirrored strategies: inline the one step in the loop; "
          "gradient_accumulation_steps > 1 there: a clear ValueError", since="3.7"),
    Patch(_TRAINER, "TensorFlowTrainer.make_train_function", (KERAS3,),
          _asking_about_accumulation(trainer.patched_make_train_function),
          "Keras 3.6, no _make_function: steps_per_execution > 1 under Mirrored strategies: no step "
          "past the data; gradient_accumulation_steps > 1 there: a clear ValueError", before="3.7"),
    Patch("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer._tf_apply", (KERAS3,),
          optimizer.patched_tf_apply, "every replica of every worker skips a non-finite step together"),
    Patch(_TF_OPTIMIZER, "TFOptimizer._all_reduce_sum_gradients", (KERAS3,),
          optimizer.patched_all_reduce_sum_gradients, "the gradient hook: gf_tf.all_reduce_gradients"),
    _ACCUMULATION_PATCH,
    Patch(_TF_OPTIMIZER, "TFOptimizer.build", (KERAS3,), optimizer.patched_build,
          "reducer state in the optimizer's checkpoint (reads TFOptimizer._distribution_strategy)"),
    Patch("keras.src.saving.saving_lib", "_raise_loading_failure", (KERAS3,),
          optimizer.patched_loading_failure,
          "load_weights: a gf_tf checkpoint mismatch's explanation first, then Keras's summary"),
    Patch("tf_keras.src.optimizers.optimizer", "Optimizer.aggregate_gradients", (TF_KERAS,),
          optimizer.patched_tf_keras_aggregate_gradients, "the gradient hook: gf_tf.all_reduce_gradients"),
    Patch("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2._aggregate_gradients",
          (TF_KERAS,), optimizer.patched_tf_keras_aggregate_gradients,
          "the gradient hook of legacy optimizers: gf_tf.all_reduce_gradients"),
    Patch("tf_keras.src.engine.training", "Model.make_train_function", (TF_KERAS,),
          trainer.patched_tf_keras_make_train_function,
          "steps_per_execution=1 under Mirrored strategies: no step past the data's end"),
)

OVERRIDES = (
    Override("keras.src.saving.keras_saveable", "KerasSaveable", "GradientFlowCheckpoint",
             "its base: Keras's weight saving walks the optimizer's KerasSaveable attributes"),
    Override("keras.src.saving.keras_saveable", "KerasSaveable._obj_type", "GradientFlowCheckpoint",
             "'Loss', a type saving_lib.get_attr_skipset accepts and whose skip list hides nothing"),
    Override("keras.callbacks", "BackupAndRestore._save_model", "BackupAndRestore",
             "the chief writes Keras's backup, every other worker only its reducer state"),
)
