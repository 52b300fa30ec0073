"""LocalSGD: local SGD and DiLoCo in Keras `model.fit`, workers meeting through GradientFlow's wire.

Post-local SGD: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR'20 (PyTorch:
`torch.distributed.algorithms.model_averaging`, `PostLocalSGDOptimizer`). DiLoCo: Douillard et
al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023 (torchft's
`DiLoCo`). docs/local-sgd.md says when each wins and loses.
"""

import logging

import numpy as np
import tensorflow as tf
import keras

from gf_tf import tf_internal
from gf_tf.checks import is_int_at_least
from gf_tf.keras.checkpoint_checks import keeps_state
from gf_tf.local_steps import MEETING, LocalSteps

AVERAGE = "average"
NESTEROV = "nesterov"
DILOCO_LEARNING_RATE = 0.7   # DiLoCo's outer Nesterov SGD (Douillard et al., 2023, s3)
DILOCO_MOMENTUM = 0.9
# Post-local SGD starts from synchronous steps (Lin et al., ICLR 2020): a replica's first solo steps
# take 1/R of the global batch at the global batch's learning rate and can run away before the
# weights settle (the digits CNN at N = 4: docs/local-sgd.md, "Warm-up").
DEFAULT_WARMUP_STEPS = 50
"""`LocalSGD(warmup_steps=)`: synchronous steps before the first local one."""
# The model's optimizer holds the outer optimizer under this attribute, so Keras's weight saving
# (save_weights, ModelCheckpoint, BackupAndRestore) saves and loads its state with the model's.
OUTER_ATTRIBUTE = "_gf_tf_local_sgd_outer"
_log = logging.getLogger(__name__)


def outer_optimizer_named(name: str, learning_rate: float = DILOCO_LEARNING_RATE,
                          momentum: float = DILOCO_MOMENTUM) -> keras.optimizers.Optimizer:
    """The outer optimizer of `LocalSGD(outer_optimizer=name)`: "average" is SGD(1.0) (the start
    point minus the mean pseudo-gradient: the mean of the workers' weights); "nesterov" is
    DiLoCo's SGD(learning_rate, momentum, nesterov=True). ValueError for another name."""
    if name == AVERAGE:
        return keras.optimizers.SGD(1.0, name="local_sgd_average")
    if name == NESTEROV:
        return keras.optimizers.SGD(learning_rate, momentum=momentum, nesterov=True,
                                    name="local_sgd_nesterov")
    raise ValueError(f"LocalSGD: outer_optimizer must be None, {AVERAGE!r}, {NESTEROV!r} or an "
                     f"unbuilt keras.optimizers.Optimizer, got {name!r}")


class LocalSGD(keras.callbacks.Callback, LocalSteps):
    """Keras callback: every replica trains alone for `sync_every` steps, then all meet.

    Pass it to `model.fit(callbacks=[...])` of a model compiled under a
    `gf_tf.MultiWorkerMirroredStrategy` or a `tf.distribute.MirroredStrategy` whose
    cross-device ops are a `gf_tf.GradientFlowAllReduce` (Keras 3).

    - Inner steps: the optimizer's gradient all-reduce is local (no collective; the
      GradientFlowAllReduce's `CommStats` counts the step with 0 bytes sent): each replica
      applies its own gradient, R times its share of the Keras sum (R = replicas in sync),
      to its own copy of the weights, which then differ between replicas.
    - Meetings, every `sync_every` optimizer steps after the warm-up, at the last batch of
      each epoch (when Keras knows the epoch's length), before `evaluate`/`predict` run by
      fit's validation, at an epoch's and at training's end: each replica's pseudo-gradient
      (start point - its weights) / R goes through the optimizer's all-reduce of the
      GradientFlowAllReduce (its packing, FP16 with power-of-two scaling, CSC or LowRank as
      configured, with state of its own), and `outer_optimizer` applies the sum, the mean
      pseudo-gradient, to the shared start point, which every replica then takes as its
      weights: bitwise equal on every worker; `CommStats` adds its sent bytes to the steps'
      totals without counting a step (`gf_tf.local_steps.MEETING`), so its per-step figures
      stay per optimizer step. Non-trainable float weights (BatchNorm moving statistics) are
      averaged at each meeting the same way (outer SGD(1.0)).
    - The first `warmup_steps` steps are synchronous (the ordinary all-reduce); the inner
      optimizer's state (momentum) stays per replica, never averaged (as in PyTorch's
      PostLocalSGDOptimizer), and `gf_tf.keras.backup.BackupAndRestore` saves and restores
      each replica's own. Steps are counted by the inner optimizer's `iterations`, the
      same on every worker, so every worker meets at the same step.

    `ModelCheckpoint`/`BackupAndRestore` saving per epoch see met weights; saving every N
    batches sees met weights only when N is a multiple of `sync_every` and this callback is
    listed before the saving one. The outer optimizer's state (DiLoCo's momentum, its step
    count) is saved with the model's optimizer (under `optimizer/_gf_tf_local_sgd_outer`) once
    a fit with this callback has begun; a restore reaches it when the callback's fit began
    first (list LocalSGD before `BackupAndRestore`), else the outer optimizer starts afresh.

    Args:
      sync_every (int): H >= 1, inner steps between meetings (1: every step, which with
        outer "average" and plain SGD is synchronous SGD).
      outer_optimizer (None | str | keras.optimizers.Optimizer): None or "average"
        (post-local SGD: model averaging), "nesterov" (DiLoCo: SGD lr 0.7, momentum 0.9,
        Nesterov; `outer_optimizer_named` for other values), or an unbuilt Keras optimizer,
        applied to the start point with the mean pseudo-gradient as its gradient.
      warmup_steps (int): >= 0 synchronous steps before the first local one (default
        DEFAULT_WARMUP_STEPS, 50; 0 trains alone from the first step).

    Raises:
      ValueError: sync_every < 1 or not an int, warmup_steps < 0, an unknown or built outer
        optimizer; at fit's start: a strategy without a GradientFlowAllReduce,
        gradient_accumulation_steps > 1, a GradientFlowAllReduce serving another LocalSGD.
    """

    def __init__(self, sync_every: int, outer_optimizer=None,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS):
        super().__init__()
        if not is_int_at_least(sync_every, 1):
            raise ValueError(f"LocalSGD: sync_every must be an int >= 1 (steps between "
                             f"meetings; 1 meets every step), got {sync_every!r}")
        if not is_int_at_least(warmup_steps, 0):
            raise ValueError(f"LocalSGD: warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if outer_optimizer is None or isinstance(outer_optimizer, str):
            outer_optimizer = outer_optimizer_named(outer_optimizer or AVERAGE)
        elif not isinstance(outer_optimizer, keras.optimizers.Optimizer) or outer_optimizer.built:
            raise ValueError(f"LocalSGD: outer_optimizer must be None, {AVERAGE!r}, "
                             f"{NESTEROV!r} or an unbuilt keras.optimizers.Optimizer (a new "
                             f"one: it is built on the start point), got {outer_optimizer!r}")
        self.sync_every = int(sync_every)
        self.warmup_steps = int(warmup_steps)
        self.outer_optimizer = outer_optimizer
        self._averager = keras.optimizers.SGD(1.0, name="local_sgd_average_non_trainable")
        self._gradient_flow = None
        self._trainable_ids = self._anchor_ids = frozenset()
        self._weights = self._anchors = None
        self._meet_function = None
        self._met_at = None           # the optimizer step of the last meeting (None: not started)
        self.meetings = 0

    # --- gf_tf.local_steps.LocalSteps -------------------------------------------------

    def local_for(self, variables):
        if variables and all(id(v) in self._anchor_ids for v in variables):
            return MEETING
        if not variables or any(id(v) not in self._trainable_ids for v in variables):
            return None
        if self.warmup_steps == 0:
            return True
        iterations = self.model.optimizer.iterations
        return lambda: tf.greater_equal(tf.convert_to_tensor(iterations.value), self.warmup_steps)

    # --- Keras ---------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        self._gradient_flow = gradient_flow_of(model.distribute_strategy)
        if getattr(model.optimizer, "gradient_accumulation_steps", None):
            raise ValueError("LocalSGD: gradient_accumulation_steps does not combine with local "
                             "steps; drop it (a larger sync_every also talks less often)")
        if self._gradient_flow.local_steps not in (None, self):
            raise ValueError("LocalSGD: this GradientFlowAllReduce already serves another "
                             "LocalSGD; pass one LocalSGD per fit")
        self._gradient_flow.local_steps = self
        reducer = self._gradient_flow.reducer
        if getattr(self.outer_optimizer, "momentum", 0.0) and keeps_state(reducer):
            _log.warning("gf_tf: LocalSGD's outer optimizer has momentum %g and the meetings go "
                         "through %s, whose error feedback already carries what a meeting does "
                         "not send: the two together diverged in gf_tf's measurements "
                         "(docs/local-sgd.md). Use outer_optimizer=\"average\" (or one without "
                         "momentum) with a compressing reducer.",
                         self.outer_optimizer.momentum, type(reducer).__name__)
        self._trainable_ids = frozenset(id(v.value) for v in model.trainable_variables)
        if self._weights is None or [id(w) for w in self._weights] != \
                [id(w) for w in _float_weights(model)]:
            self._build(model)
        self._met_at = None
        if model.train_function is not None:   # traced without local steps: trace again
            model.make_train_function(force=True)

    def on_train_batch_begin(self, batch, logs=None):
        if self._met_at is None:   # after any restore (BackupAndRestore loads in on_train_begin)
            self._start_from_weights()

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        if step <= self.warmup_steps:   # synchronous steps: every replica holds the same weights
            self._start_from_weights()
            return
        last_batch = self.params.get("steps") is not None and batch + 1 >= self.params["steps"]
        if step - self._met_at >= self.sync_every or last_batch:
            self.meet()

    def on_epoch_end(self, epoch, logs=None):
        self._meet_if_apart()

    def on_test_begin(self, logs=None):   # fit's validation
        self._meet_if_apart()

    def on_predict_begin(self, logs=None):
        self._meet_if_apart()

    def on_train_end(self, logs=None):
        self._meet_if_apart()
        if self._gradient_flow is not None and self._gradient_flow.local_steps is self:
            self._gradient_flow.local_steps = None
            self.model.train_function = None   # a later fit traces its step without local steps
        self._trainable_ids = frozenset()

    # --- each replica's own inner state (gf_tf.keras.backup) -------------------------------

    def replica_state(self) -> dict:
        """This worker's inner optimizer state replica by replica (eager): {"v<i>_r<r>": local
        replica r's copy of the model optimizer's i-th float variable (momentum, Adam's moments;
        each replica's own between meetings, while Keras's checkpoint holds one copy),
        "iterations": int64 scalar, the optimizer's step}."""
        arrays = {"iterations": np.asarray(self._step(), np.int64)}
        for i, copies in enumerate(self._inner_copies()):
            arrays.update({f"v{i}_r{r}": copy.numpy() for r, copy in enumerate(copies)})
        return arrays

    def restore_replica_state(self, arrays) -> str:
        """Assigns `replica_state`'s arrays to every local replica's copy; returns "" or, with
        nothing assigned, why not (saved at another step, or for other variables)."""
        if int(arrays["iterations"]) != self._step():
            return (f"saved at step {int(arrays['iterations'])}, the restored optimizer is at "
                    f"step {self._step()}")
        copies = self._inner_copies()
        wanted = {f"v{i}_r{r}": c for i, cs in enumerate(copies) for r, c in enumerate(cs)}
        if set(wanted) != set(arrays) - {"iterations"} or any(
                tuple(c.shape) != arrays[k].shape for k, c in wanted.items()):
            return "saved for other optimizer variables or replicas"
        for key, copy in wanted.items():
            copy.assign(arrays[key])
        return ""

    def _inner_copies(self):
        """Per float variable of the model's optimizer, its local replicas' copies."""
        strategy = self.model.distribute_strategy
        return [strategy.experimental_local_results(v.value) for v in self.model.optimizer.variables
                if tf.as_dtype(v.dtype).is_floating]

    # --- meetings ----------------------------------------------------------------------

    def meet(self) -> None:
        """All replicas meet now (every worker must call it at the same step, as fit does)."""
        self._meet_function()
        self._met_at = self._step()
        self.meetings += 1

    def _meet_if_apart(self):
        if self._met_at is not None and self._step() != self._met_at:
            self.meet()

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _start_from_weights(self):
        for anchor, weight in zip(self._anchors, self._weights):
            anchor.assign(weight.value)
        self._met_at = self._step()

    def _build(self, model):
        """The start point (a copy of every float weight) and the outer optimizers, in the
        strategy's scope (mirrored like the weights), and the meeting's tf.function."""
        strategy = model.distribute_strategy
        self._weights = _float_weights(model)
        trainable = {id(w) for w in model.trainable_weights}
        with strategy.scope():
            # From a tensor: keras.Variable(<a tf.Variable>) would be that same variable.
            self._anchors = [keras.Variable(tf.convert_to_tensor(w.value), dtype=w.dtype,
                                            trainable=True,
                                            name=f"local_sgd_start_{i}")
                             for i, w in enumerate(self._weights)]
        self._anchor_ids = frozenset(id(a.value) for a in self._anchors)
        pairs = list(zip(self._weights, self._anchors))
        outer_pairs = [(w, a) for w, a in pairs if id(w) in trainable]
        averaged_pairs = [(w, a) for w, a in pairs if id(w) not in trainable]
        outer = [a for _, a in outer_pairs]
        averaged = [a for _, a in averaged_pairs]
        with strategy.scope():   # a Keras optimizer belongs to the strategy it was created in
            self.outer_optimizer = _copy(self.outer_optimizer)
            self.outer_optimizer.build(outer)
            self._averager = _copy(self._averager)
            if averaged:
                self._averager.build(averaged)
        setattr(model.optimizer, OUTER_ATTRIBUTE, self.outer_optimizer)

        def replica_step():
            scale = 1.0 / strategy.num_replicas_in_sync

            def pseudo_gradients(weight_anchor_pairs):
                return [(tf.convert_to_tensor(a.value) - tf.convert_to_tensor(w.value)) * scale
                        for w, a in weight_anchor_pairs]

            self.outer_optimizer.apply(pseudo_gradients(outer_pairs), outer)
            if averaged:
                self._averager.apply(pseudo_gradients(averaged_pairs), averaged)

        @tf.function(autograph=False)
        def meet():
            strategy.run(replica_step)
            for weight, anchor in pairs:
                weight.assign(anchor.value)

        self._meet_function = meet


def gradient_flow_of(strategy):
    """The strategy's GradientFlowAllReduce, or ValueError naming how to get one."""
    from gf_tf.cross_device_ops import GradientFlowAllReduce  # pylint: disable=import-outside-toplevel
    ops = tf_internal.strategy_cross_device_ops(strategy)
    if not isinstance(ops, GradientFlowAllReduce):
        raise ValueError(
            f"LocalSGD needs a strategy whose cross-device ops are a gf_tf.GradientFlowAllReduce "
            f"(its workers meet through it), got {type(strategy).__name__} with "
            f"{type(ops).__name__ if ops is not None else 'no cross-device ops'}: compile the "
            f"model under gf_tf.MultiWorkerMirroredStrategy() or "
            f"tf.distribute.MirroredStrategy(cross_device_ops=gf_tf.GradientFlowAllReduce())")
    return ops


def _copy(optimizer):
    """A new, unbuilt optimizer of `optimizer`'s class and config (in the current strategy)."""
    return type(optimizer).from_config(optimizer.get_config())


def _float_weights(model) -> list:
    """The model's floating-point weights (trainable first, as Keras lists them)."""
    return [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]

