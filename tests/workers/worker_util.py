"""Worker-side half of tests/cluster.py: options from the environment, writing the result."""

import json
import os

import numpy as np


def comm_timeout() -> float:
    """Seconds for CommunicationOptions(timeout_seconds=...), set by tests/cluster.py."""
    return float(os.environ.get("GF_TF_COMM_TIMEOUT", "30"))


def task_index() -> int:
    return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def communication_options():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.distribute.experimental.CommunicationOptions(timeout_seconds=comm_timeout())


def regression_data(num_examples: int):
    """Seeded (x float32 [n, 8], y float32 [n, 3]): a noisy linear map, the same on every worker."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3)) + 0.1 * rng.normal(size=(num_examples, 3))).astype(np.float32)
    return x, y


def mlp_fit_setup(learning_rate: float):
    """(dataset, build): 64 seeded examples (12 -> 3, tanh of a linear map) in batches of 16, and
    a function building the seeded 4-layer tanh MLP compiled with SGD(learning_rate) and MSE
    (call it inside the strategy's scope)."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(12, 3))).astype(np.float32)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(48, activation="tanh"),
                                  keras.layers.Dense(40, activation="tanh"),
                                  keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
        return model
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16), build


def write_result(**arrays) -> None:
    """Saves named arrays where tests/cluster.py reads them (GF_TF_RESULT)."""
    np.savez(os.environ["GF_TF_RESULT"], **{k: np.asarray(v) for k, v in arrays.items()})


def nested_ops(graph, key=None, seen=None):
    """Every op of `graph` and of the graphs it runs: nested tf.functions and the branch graphs of
    its conds and switch_cases, each graph once (test-only use of FuncGraph's `_get_function` and
    cond_v2's `If._true_graph/_false_graph`)."""
    seen = set() if seen is None else seen
    key = id(graph) if key is None else key
    if key in seen:
        return
    seen.add(key)
    for op in graph.get_operations():
        yield op
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):   # a nested tf.function
            callee = op.get_attr("f").name
            function = graph._get_function(callee)  # pylint: disable=protected-access
            if function is not None and getattr(function, "graph", None) is not None:
                yield from nested_ops(function.graph, callee, seen)
        for branch in ("_true_graph", "_false_graph"):
            if getattr(op, branch, None) is not None:
                yield from nested_ops(getattr(op, branch), id(getattr(op, branch)), seen)
        if op.type in ("Case", "StatelessCase"):   # a tf.switch_case's branch functions
            for function in op.get_attr("branches"):
                branch = graph._get_function(function.name)  # pylint: disable=protected-access
                if branch is not None:
                    yield from nested_ops(branch.graph, function.name, seen)


def collective_reduces(model):
    """(dtype name, element count) of every CollectiveReduceV2 in the model's traced train step.

    Reads the concrete functions behind `model.train_function` and the graphs they run
    (`nested_ops`; test-only use of tf.function's `_list_all_concrete_functions`).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    found, seen = [], set()

    def scan(graph, name):
        for op in nested_ops(graph, name, seen):
            if op.type == "CollectiveReduceV2":
                found.append((op.get_attr("T").name, op.inputs[0].shape.num_elements()))

    def walk(obj):
        if isinstance(obj, tf.types.experimental.PolymorphicFunction):
            for concrete in obj._list_all_concrete_functions():  # pylint: disable=protected-access
                scan(concrete.graph, tf.compat.as_str(concrete.name))
            # Keras 3.6's train_function is the tf.function itself: its step is in the closure
            # of the Python function it wraps.
            obj = getattr(obj, "python_function", None)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                c = cell.cell_contents
            except ValueError:
                continue
            if id(c) in seen:
                continue
            seen.add(id(c))
            if callable(c):
                walk(c)

    walk(model.train_function)
    return found


def checkpoint_strategy(reducer="csc", selection="per_pack"):
    """(GradientFlowAllReduce, gf_tf.MultiWorkerMirroredStrategy) of the checkpoint workers.

    reducer "csc": CSC at density 0.1 in chunks of 16, 3 warm-up steps, momentum correction 0.5,
    chunks chosen by `selection`; "csc_auto": CSC in chunks of 16 with momentum correction 0.5 at
    density="auto" (critical-regime windows of 2 steps, change 0.5, floor 0.01 but at least 2
    chunks) on a fake clock (1 s of compute, 10 s of communication a step: every rung the price
    picks, measured or not, is the floor), so the rungs follow the regime alone; "lowrank":
    gf_tf.reducers.LowRank(rank=2) on the FP16 wire in one pack, ring all-reduce.
    """
    import gf_tf  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if reducer == "csc_auto":
        rule = gf_tf.csc.AutoDensity(min_density=0.01, regime_window=2, regime_change=0.5,
                                     min_chunks=2)
        gradient_flow = gf_tf.GradientFlowAllReduce(
            compression="fp16", bytes_per_pack=4 << 20, algorithm="ring",
            sparsity=gf_tf.ChunkSparsity(density=rule, chunk_size=16, momentum=0.5))
        strategy = gf_tf.MultiWorkerMirroredStrategy(
            communication_options=communication_options(), gradient_flow=gradient_flow)
        # After the strategy: a variable would start the TF runtime before it configures collectives.
        with tf.device("/cpu:0"):
            clock = tf.Variable(100.0, dtype=tf.float64, trainable=False)
        gradient_flow.reducer.clock = lambda replica, event: clock.assign_add(
            {"ready": 1.0, "send": 0.0, "done": 10.0}[event])
        return gradient_flow, strategy
    if reducer == "lowrank":
        gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0,
                                                    algorithm="ring",
                                                    reducer=gf_tf.reducers.LowRank(rank=2, warmup_steps=0))
    else:
        sparsity = gf_tf.ChunkSparsity(density=0.1, chunk_size=16, warmup_steps=3, momentum=0.5,
                                       selection=selection)
        gradient_flow = gf_tf.GradientFlowAllReduce(sparsity=sparsity)
    strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=communication_options(),
                                                 gradient_flow=gradient_flow)
    return gradient_flow, strategy


def gradient_step(gradient_flow, shapes):
    """(strategy, step_fn) for a worker that all-reduces gradients of variables of `shapes` through
    `gradient_flow` with gf_tf.all_reduce_gradients, one replica per worker: step_fn(grads) ->
    the reduced gradients (a tf.function over strategy.run)."""
    import gf_tf  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=communication_options(),
                                                 gradient_flow=gradient_flow)
    with tf.init_scope():
        variables = [tf.Variable(tf.zeros(shape), name=f"v{i}") for i, shape in enumerate(shapes)]

    @tf.function
    def step_fn(grads):
        def replica(*g):
            g = [tf.identity(t) for t in g]
            return gf_tf.all_reduce_gradients(g, variables, options=communication_options())
        return strategy.run(replica, args=tuple(grads))

    return strategy, step_fn


def random_steps(strategy, step_fn, shapes, steps, before_step=lambda step: {}):
    """Runs `steps` steps of fresh standard-normal gradients of `shapes` (seeded by step and
    rank) through step_fn; returns {g{step}_{i}: gradient, out{step}_{i}: reduced} plus, per
    step, what before_step(step) returns before it runs."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    arrays = {}
    for step in range(steps):
        arrays.update(before_step(step))
        rng = np.random.default_rng([step, task_index()])
        grads = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        out = step_fn([tf.constant(g) for g in grads])
        for i, (g, o) in enumerate(zip(grads, out)):
            arrays[f"g{step}_{i}"] = g
            arrays[f"out{step}_{i}"] = strategy.experimental_local_results(o)[0].numpy()
    return arrays
