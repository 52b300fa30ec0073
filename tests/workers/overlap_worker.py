"""One worker of tests/test_overlap.py: FP16 packs in groups (overlap) against one barrier.

--mode values: gf_tf.all_reduce_gradients of this worker's fresh random gradients (sizes 1,
  7, 1009, values near 65504, FP16 subnormals, float32/float16/bfloat16), once with
  overlap=True and once with the same GradientFlowAllReduce set to one barrier (overlap=False,
  a new trace). Writes what it sent, both sums and both plans' group counts.
--mode csc: CSC (density 0.25, chunks of 16, one dense warm-up step, float32 wire) over
  packs of --bytes_per_pack with overlap on or off (--overlap): each pack a group of its own,
  or one barrier. Gradients come from --seed, this worker's rank and the step, so runs with
  each form see the same ones. Writes per step what it sent and received, each pack's
  gradient indices and final residual, and the plan's group count.
--mode fit: model.fit of a 4-layer MLP with overlap on or off (--overlap), FP16 or CSC at
  --density (chunks of 16, one dense warm-up step), or --baseline (one process, no strategy,
  float32). Writes the final weights and, from the traced train step,
  whether the first group's collectives have a data or control path from the gradient of the
  first layer's kernel (which is in the last group when the packs are grouped).
--mode conv_fit: model.fit of 2 convolutions and a dense layer, all with biases, in packs of
  2048 bytes, so a layer's kernel and bias travel in different groups (oneDNN fuses their
  gradient ops); writes the final weights and the plan's group count.
"""

import argparse
import dataclasses
import re

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["values", "csc", "fit", "conv_fit"], default="values")
parser.add_argument("--seed", type=int, default=0, help="--mode csc: the gradients' seed")
parser.add_argument("--density", type=float, default=0.0, help="--mode fit, conv_fit: CSC at this density")
parser.add_argument("--algorithm", default="ring")
parser.add_argument("--bytes_per_pack", type=int, default=1024)
parser.add_argument("--overlap", choices=["on", "off"], default="on")
parser.add_argument("--baseline", action="store_true", help="fit in one process, no strategy")
parser.add_argument("--learning_rate", type=float, default=0.05, help="SGD's")
parser.add_argument("--selection", default="per_pack", help="--mode fit: CSC's selection")
args = parser.parse_args()

import gf_tf  # pylint: disable=wrong-import-position

# The collectives of a group, and the switch_case holding CSC's chunk all-reduce (its branches).
COLLECTIVES = ("CollectiveReduceV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "Case")
GROUP = re.compile(r"gf_group(\d+)/")


def strategy_with(overlap):
    sparsity = (gf_tf.ChunkSparsity(density=args.density, chunk_size=16, warmup_steps=1,
                                    selection=args.selection)
                if args.density else None)
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=args.bytes_per_pack,
                                                algorithm=args.algorithm, overlap=overlap,
                                                sparsity=sparsity)
    return gf_tf.MultiWorkerMirroredStrategy(
        communication_options=worker_util.communication_options(), gradient_flow=gradient_flow)


def nasty_gradients(rng, replicas):
    """This worker's gradients: (name, NumPy value, dtype); float16 sums stay below 65504."""
    def normal(n, scale=1.0):
        return rng.normal(size=n) * scale
    return [("f32_one", normal(1), tf.float32),
            ("f32_near_max", np.sign(normal(7)) * rng.uniform(60000, 65504, 7), tf.float32),
            ("f32_tiny", normal(1009, 1e-6), tf.float32),
            ("f16_subnormal", rng.uniform(-5e-5, 5e-5, 7), tf.float16),
            ("f16_near_max", np.sign(normal(1009)) * rng.uniform(0.9, 1, 1009) * 64000 / replicas,
             tf.float16),
            ("bf16", normal(7, 1e3), tf.bfloat16),
            ("f32_wide", normal((9, 5)) * 10.0 ** rng.integers(-8, 8, (9, 5)), tf.float32),
            ("bf16_big", normal(1009), tf.bfloat16),
            ("f16_one", normal(1), tf.float16),
            ("f32_big", normal(1009), tf.float32)]


def run_values():
    strategy = strategy_with(True)
    gfar = strategy.gradient_flow
    grads = nasty_gradients(np.random.default_rng(), strategy.num_replicas_in_sync)
    # What each worker sends, exactly as its dtype holds it (the reference is computed from this).
    sent = [tf.cast(tf.constant(v, tf.float64), d) for _, v, d in grads]
    with strategy.scope():   # float32: TF's initial-value broadcast takes no bfloat16 (the
        # variables only name the set; the gradients keep their dtypes)
        variables = [tf.Variable(tf.zeros(s.shape), name=n) for s, (n, _, _) in zip(sent, grads)]

    def traced_step():
        @tf.function
        def step():
            return strategy.run(lambda: gf_tf.all_reduce_gradients(list(sent), variables))
        return [strategy.experimental_local_results(t)[0] for t in step()]

    result = {}
    for form, overlap in (("overlap", True), ("barrier", False)):
        # The same GradientFlowAllReduce, retraced with one barrier (its settings are read-only
        # properties now: replace them, checked again by gf_tf.plan.Settings).
        settings = gfar._settings  # pylint: disable=protected-access
        gfar._settings = dataclasses.replace(settings, overlap=overlap)  # pylint: disable=protected-access
        traced_step()   # the first step of the set: float32 retries (no bounds a step ahead yet)
        for (name, _, _), s, got in zip(grads, sent, traced_step()):
            result[f"sent_{name}"] = tf.cast(s, tf.float64).numpy()
            result[f"{form}_{name}"] = tf.cast(got, tf.float64).numpy()
            result[f"dtype_{name}"] = np.array(s.dtype.name)
        (report,) = gfar.plans().values()
        result[f"{form}_groups"] = np.array(report.plan.groups)
        result[f"{form}_plan"] = np.array(report.describe())
    worker_util.write_result(**result)


CSC_SHAPES = [(7, 3), (1009,), (5,), (64,), (33, 2), (1,)]
CSC_STEPS = 4


def run_csc():
    gfar = gf_tf.GradientFlowAllReduce(
        compression=None, bytes_per_pack=args.bytes_per_pack, algorithm=args.algorithm,
        overlap=args.overlap == "on",
        sparsity=gf_tf.ChunkSparsity(density=0.25, chunk_size=16, warmup_steps=1))
    strategy = gf_tf.MultiWorkerMirroredStrategy(
        communication_options=worker_util.communication_options(), gradient_flow=gfar)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s), name=f"v{i}") for i, s in enumerate(CSC_SHAPES)]

    @tf.function
    def step(grads):
        return strategy.run(lambda: gf_tf.all_reduce_gradients([tf.identity(g) for g in grads],
                                                                variables))

    result = {}
    for s in range(CSC_STEPS):
        rng = np.random.default_rng([args.seed, worker_util.task_index(), s])
        # Chunk scales spread over 3 orders of magnitude: the top k is well separated.
        grads = [(rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 1, shape)).astype(np.float32)
                 for shape in CSC_SHAPES]
        out = step([tf.constant(g) for g in grads])
        for i, (g, got) in enumerate(zip(grads, out)):
            result[f"sent{s}_{i}"] = g
            result[f"sum{s}_{i}"] = strategy.experimental_local_results(got)[0].numpy()
    (state,) = gfar.states().values()
    for p, (spec, pack) in enumerate(zip(state.pack_specs, state.pack_states)):
        result[f"pack{p}_indices"] = np.array(spec.indices)
        result[f"pack{p}_residual"] = pack.residuals[0].numpy()
    (report,) = gfar.plans().values()
    result["groups"] = np.array(report.plan.groups)
    worker_util.write_result(**result)


def ancestors(ops):
    """Every op with a data or control path to one of `ops` (op.inputs, op.control_inputs)."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def graph_facts(model, recorded):
    """(groups seen, collectives per group, first group reached from the first kernel's gradient)."""
    graph, name = recorded[tuple(model.layers[0].kernel.shape)]
    gradient_op = graph.get_tensor_by_name(name).op
    per_group = {}
    for op in graph.get_operations():
        match = GROUP.search(op.name)
        if match and op.type in COLLECTIVES:
            per_group.setdefault(int(match.group(1)), []).append(op)
    last = max(per_group)
    groups_of_kernel = sorted({int(GROUP.search(c.name).group(1)) for c in graph.get_operations()
                               if GROUP.search(c.name) and gradient_op in [t.op for t in c.inputs]})
    return {"groups_seen": np.array(len(per_group)),
            "collectives_per_group": np.array([len(per_group[g]) for g in sorted(per_group)]),
            "kernel_gradient_groups": np.array(groups_of_kernel),
            "last_group": np.array(last),
            "first_reached_from_kernel": np.array(gradient_op in ancestors(per_group[0])),
            "last_reached_from_kernel": np.array(gradient_op in ancestors(per_group[last])),
            # TF's ordering token chains a device's collectives in trace order: every group's
            # collectives come after the previous group's (the same order on every worker).
            "groups_in_trace_order": np.array(all(
                set(per_group[g - 1]) & ancestors(per_group[g]) for g in sorted(per_group)[1:]))}


def run_fit():
    result, strategy = {}, None
    if not args.baseline:   # before any TF op: the strategy configures the collectives
        strategy = strategy_with(args.overlap == "on")
        gfar = strategy.gradient_flow
        recorded = {}
        original = gfar.all_reduce_gradients

        def recording(replica_ctx, grads, variables, reduce_op, options=None):
            for g, v in zip(grads, variables):   # the gradient tensors as the step traced them
                recorded[tuple(v.shape)] = (g.graph, g.name)   # this model's shapes are distinct
            return original(replica_ctx, grads, variables, reduce_op, options)
        gfar.all_reduce_gradients = recording
    dataset, build_model = worker_util.mlp_fit_setup(args.learning_rate)
    if strategy is None:
        model = build_model()
    else:
        with strategy.scope():
            model = build_model()
    model.fit(dataset, epochs=2, verbose=0)
    result.update({f"w{i}": w for i, w in enumerate(model.get_weights())})
    if not args.baseline:
        (report,) = gfar.plans().values()
        result["groups"] = np.array(report.plan.groups)
        result["plan"] = np.array(report.describe())
        result.update(graph_facts(model, recorded))
    worker_util.write_result(**result)


def run_conv_fit():
    import keras  # pylint: disable=import-outside-toplevel
    strategy = strategy_with(args.overlap == "on")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        x = inputs = keras.Input((12, 12, 8))
        x = keras.layers.Conv2D(16, 5, activation="relu")(x)
        x = keras.layers.Conv2D(16, 3, activation="relu")(x)
        outputs = keras.layers.Dense(10)(keras.layers.Flatten()(x))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(32, 12, 12, 8)).astype(np.float32),
                                               rng.integers(0, 10, 32))).batch(8)
    model.fit(data, epochs=1, verbose=0)
    (report,) = strategy.gradient_flow.plans().values()
    worker_util.write_result(groups=np.array(report.plan.groups),
                             **{f"w{i}": w for i, w in enumerate(model.get_weights())})


if args.mode == "values":
    run_values()
elif args.mode == "csc":
    run_csc()
elif args.mode == "conv_fit":
    run_conv_fit()
else:
    run_fit()
