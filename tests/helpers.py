"""In-process helpers shared by test modules: GradientFlowAllReduce under MirroredStrategy on
the logical CPU devices (tests/conftest.py), the CSC state it keeps, the ops of a traced step,
and GRADIENT_SCALE (Keras's gradient scale across replicas, for float64 references)."""

import numpy as np
import tensorflow as tf

import gf_tf
from gf_tf.plan import DEFAULT_BYTES_PER_PACK, Costs
from gf_tf.keras import flavour, patches

# Logical CPU devices: configured by tests/conftest.py before TF initialises.
DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
assert len(DEVICES) >= 3, f"tests/conftest.py should configure >= 3 logical CPUs, got {DEVICES}"

# Keras 3.6 and 3.7 divide each replica's loss by its own batch (8 of 16 here, on 2 replicas or 2
# workers) and the optimizer sums the replicas' gradients: 2x the gradient of the global batch's mean
# loss (stock Keras alike; 3.7.0 has no `scale_loss_for_distribution` yet). Keras 3.8 on and tf-keras
# scale to the global batch.
GRADIENT_SCALE = 2.0 if not flavour.uses_tf_keras() and patches.keras3_minor() < (3, 8) else 1.0


def fp16_pack_bytes(elements, tensors, retries=0.0):
    """Bytes one float32 pack of `elements` elements in `tensors` tensors sends on the FP16 wire,
    scaled a step ahead (gf_tf.reducers.dense): the values and `wire.ahead_slots` in FP16, plus
    per float32 retry (`retries`: a count, or a mean per step) 4 bytes per element and tensor."""
    return 2 * (elements + gf_tf.wire.ahead_slots(tensors)) + retries * 4 * (elements + tensors)


class Runner:
    """One traced all-reduce step of `num_replicas` replicas through GradientFlowAllReduce."""

    def __init__(self, num_replicas, sparsity, compression="fp16",
                 bytes_per_pack=DEFAULT_BYTES_PER_PACK):
        self.sparsity = sparsity
        self.gfar = gf_tf.GradientFlowAllReduce(
            compression=compression, sparsity=sparsity, bytes_per_pack=bytes_per_pack,
            cross_device_ops=tf.distribute.ReductionToOneDevice())
        self.strategy = tf.distribute.MirroredStrategy(DEVICES[:num_replicas],
                                                       cross_device_ops=self.gfar)

        self.variables = None   # the gradients' variables: one fixed list (the CSC state's owner)

        @tf.function
        def step(inputs):
            def replica_fn(*tensors):
                tensors = [tf.identity(t) for t in tensors]  # gives them the replica's device
                return gf_tf.all_reduce_gradients(tensors, self.variables)
            return self.strategy.run(replica_fn, args=inputs)

        self._step = step

    def __call__(self, grads):
        """grads[r] = list of arrays of replica r -> per replica, list of reduced arrays."""
        if self.variables is None or len(self.variables) != len(grads[0]):
            self.variables = [tf.Variable(0.0, name=f"v{i}") for i in range(len(grads[0]))]
        inputs = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tuple(tf.constant(a) for a in grads[ctx.replica_id_in_sync_group]))
        out = self._step(inputs)
        per_value = [self.strategy.experimental_local_results(o) for o in out]
        return [[v[r].numpy() for v in per_value] for r in range(len(grads))]

    def state(self):
        return only_state(self.gfar)

    def residuals(self):
        return [v.numpy() for v in self.state().residuals]


def only_state(gfar):
    """The CSC state of the one pack of the one variable set `gfar` serves."""
    (variable_set,) = gfar.states().values()
    (state,) = variable_set.pack_states
    return state


def three_pack_step(csc, sizes, clock=None):
    """(gfar, strategy, step): 2 replicas, float32 wire, one pack per variable of `sizes`
    (bytes_per_pack=16); step(*per_replica) all-reduces one gradient per variable."""
    gfar = gf_tf.GradientFlowAllReduce(bytes_per_pack=16, sparsity=csc, compression=None,
                                       cross_device_ops=tf.distribute.ReductionToOneDevice())
    if clock is not None:
        gfar.reducer.clock = clock
    strategy = tf.distribute.MirroredStrategy(DEVICES[:2], cross_device_ops=gfar)
    variables = [tf.Variable(np.zeros(n, np.float32)) for n in sizes]

    @tf.function
    def step(*per_replica):
        def fn(*grads):
            return gf_tf.all_reduce_gradients([tf.identity(g) for g in grads], variables)
        return strategy.run(fn, args=per_replica)
    return gfar, strategy, step


def all_ops(graph):
    """The ops of a graph and of the branch functions of its cond / switch_case ops."""
    for op in graph.get_operations():
        yield op
        for attr in ("then_branch", "else_branch", "branches"):
            try:
                fns = op.get_attr(attr)
            except (ValueError, TypeError):
                continue
            for fn in fns if isinstance(fns, list) else [fns]:
                yield from all_ops(graph._get_function(fn.name).graph)  # pylint: disable=protected-access


def pack_states(run):
    """(tensor index of each pack, its CSC state), in pack order; one tensor per pack."""
    (variable_set,) = run.gfar.states().values()
    assert all(len(pack.indices) == 1 for pack in variable_set.pack_specs)
    return [pack.indices[0] for pack in variable_set.pack_specs], variable_set.pack_states


def make_costs(hop_s, round_s, byte_s, copy_s, fp16_s):
    """The planner's Costs from a ring hop's and a recursive-doubling round's latency, the seconds
    per wire byte, and the local seconds per element of float32 packing (also TF's own concat +
    split, and BF16's) and of FP16 packing."""
    return Costs(byte_s=byte_s, latency_s={"ring": hop_s, "recursive_doubling": round_s},
                 local_s={"none": copy_s, "bf16": copy_s, "fp16": fp16_s})


# The planner's tests' link: 1.5 ms per hop, 3 ms per round (2 hops), 1 Gbit/s (8 ns per byte),
# 1 ns per element of copying, 2 ns of FP16 packing.
GIGABIT = make_costs(hop_s=1.5e-3, round_s=3e-3, byte_s=8e-9, copy_s=1e-9, fp16_s=2e-9)


def small_keras_model(gfar, devices=2, seed=0, hidden=16):
    """(gfar, model): an 8 -> hidden (ReLU) -> 3 MLP compiled with SGD(0.05) and MSE under a
    MirroredStrategy of `devices` logical CPUs whose cross-device ops are `gfar`."""
    import keras
    strategy = tf.distribute.MirroredStrategy(DEVICES[:devices], cross_device_ops=gfar)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return gfar, model


def regression_data():
    """(x float32 [64, 8], y float32 [64, 3]): a fixed linear regression for small_keras_model."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    return x, (x @ rng.normal(size=(8, 3))).astype(np.float32)
