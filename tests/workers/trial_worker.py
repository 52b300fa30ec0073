"""One worker of the trial tests: the default GradientFlowAllReduce with every set under trial
(gf_tf.plan.trial; planner.TIE and MODEL_ERROR opened wide).

--mode values: two variable sets, fresh random gradients every step (the last step in a new
  trace), this worker's trial clock running (1 + skew * rank) times as fast as the others' so
  the workers' local medians differ.
  Writes per step the gradients it sent, the sums it received and the bytes CommStats counted,
  the op types of the last step's graph, then each set's decision (candidate kept, measured
  seconds), effective plan and how many steps its reducer (the dense one, with a counter for
  state) reduced.
--mode fit: model.fit of a 4-layer MLP past the decision with GradientFlowStats, then
  tf.saved_model.save; or --baseline (one process, no strategy, float32). Writes the weights,
  the optimizer's iterations and the set's trial decision.
"""

import argparse
import math
import time

import numpy as np
import tensorflow as tf

import worker_util

parser = argparse.ArgumentParser()
parser.add_argument("--skew", type=float, default=5.0, help="this worker's clock x (1 + skew * rank)")
parser.add_argument("--steps", type=int, default=4, help="--mode values: steps (>= 2)")
parser.add_argument("--mode", choices=["values", "fit"], default="values")
parser.add_argument("--baseline", action="store_true", help="fit in one process, no strategy")
parser.add_argument("--learning_rate", type=float, default=0.05, help="SGD's")
parser.add_argument("--saved_model", default=None, help="--mode fit: where to save the model")
args = parser.parse_args()

import gf_tf  # after argparse
from gf_tf import reducers
from gf_tf.plan import planner

planner.TIE, planner.MODEL_ERROR = math.inf, math.inf   # every "auto" set is measured, whatever the model says


class Calls(reducers.VariablesState):
    def __init__(self):
        super().__init__()
        self.calls = tf.Variable(0, dtype=tf.int64, trainable=False)

    def named_variables(self):
        return {"calls": self.calls}


class CountingReducer(reducers.DenseReducer):
    """The dense reducer (no cost of its own: its sets are planned, and tried, as the default's)
    with state: how many steps it reduced."""

    def create_states(self, packs, devices):
        with tf.device(devices[0]):
            return Calls(), [None] * len(packs)

    def reduce(self, step):
        outputs, sent = super().reduce(step)
        with tf.control_dependencies([t for pack in outputs for replica in pack for t in replica]):
            step.shared.calls.assign_add(1)
        return outputs, sent


def run_values():
    rank = worker_util.task_index()
    strategy = gf_tf.MultiWorkerMirroredStrategy(
        communication_options=worker_util.communication_options(),
        gradient_flow=gf_tf.GradientFlowAllReduce(reducer=CountingReducer()))
    gfar = strategy.gradient_flow
    gfar.trial_clock = lambda: time.perf_counter() * (1.0 + args.skew * rank)
    shapes = {"small": [(7,), (1009,), (1,)], "large": [(300, 1000)]}
    with strategy.scope():
        variables = {name: [tf.Variable(tf.zeros(s), name=f"{name}{i}") for i, s in enumerate(sizes)]
                     for name, sizes in shapes.items()}

    @tf.function
    def step(grads):
        def fn():
            return {name: gf_tf.all_reduce_gradients([tf.identity(g) for g in grads[name]],
                                                     variables[name]) for name in grads}
        return strategy.run(fn)

    rng = np.random.default_rng()   # fresh inputs every run and every worker
    result = {}
    retraced = tf.function(step.python_function)   # the same sets in a new trace, last
    for s in range(args.steps):
        if s == args.steps - 1:
            step = retraced
        sent = {name: [(rng.normal(size=shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
                       for shape in sizes] for name, sizes in shapes.items()}
        before = gfar.stats.totals()
        out = step({name: [tf.constant(g) for g in grads] for name, grads in sent.items()})
        after = gfar.stats.totals()
        result[f"step{s}_sent_bytes"] = after["sent_bytes"] - before["sent_bytes"]
        result[f"step{s}_retries"] = (after.get("figure_float32_retries", 0.0)
                                      - before.get("figure_float32_retries", 0.0))
        for name, grads in sent.items():
            for i, (g, got) in enumerate(zip(grads, out[name])):
                result[f"step{s}_{name}_sent{i}"] = g
                result[f"step{s}_{name}_sum{i}"] = strategy.experimental_local_results(got)[0].numpy()

    graph = step.get_concrete_function(
        {name: [tf.TensorSpec(shape, tf.float32) for shape in sizes] for name, sizes in shapes.items()}
    ).graph.as_graph_def()
    result["step_ops"] = sorted({node.op for node in graph.node} |
                                {node.op for f in graph.library.function for node in f.node_def})
    states = gfar.states()
    for name, report in gfar.plans().items():
        key = "small" if "small" in name else "large"
        decision = states[name].trial
        result[f"{key}_choice"] = decision.choice
        result[f"{key}_measured"] = np.array([decision.tf_seconds, decision.gf_seconds])
        wire = states[name].planned.plan   # the GradientFlow candidate
        result[f"{key}_wire"] = wire.method
        result[f"{key}_tensors"] = len(shapes[key])
        plan = report.plan
        result[f"{key}_plan"] = f"{plan.method} {plan.bytes_per_pack} {plan.algorithm} {plan.trial}"
        result[f"{key}_plan_measured"] = np.array(report.measured, np.float64)
        result[f"{key}_elements"] = sum(int(np.prod(s)) for s in shapes[key])
        result[f"{key}_reduce_calls"] = int(states[name].shared.calls.numpy())
    worker_util.write_result(**result)


def run_fit():
    strategy = None
    if not args.baseline:   # before any TF op: the strategy configures the collectives
        strategy = gf_tf.MultiWorkerMirroredStrategy(
            communication_options=worker_util.communication_options())
    dataset, build = worker_util.mlp_fit_setup(args.learning_rate)
    epochs = 2   # 4 steps an epoch
    result = {}
    if strategy is None:
        model = build()
        model.fit(dataset, epochs=epochs, verbose=0)
    else:
        with strategy.scope():
            model = build()
        gfar = strategy.gradient_flow
        model.fit(dataset, epochs=epochs, verbose=0, callbacks=[gf_tf.GradientFlowStats(gfar)])
        ((name, state),) = gfar.states().items()
        decision = state.trial
        result.update(choice=decision.choice,
                      measured=np.array([decision.tf_seconds, decision.gf_seconds]),
                      plan=gfar.plans()[name].describe(),
                      stats_steps=gfar.stats.totals()["steps"])
        if args.saved_model:
            tf.saved_model.save(model, args.saved_model)
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result.update({f"w{i}": w for i, w in enumerate(model.get_weights())})
    worker_util.write_result(**result)


if args.mode == "values":
    run_values()
else:
    run_fit()
