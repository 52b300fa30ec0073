"""One variable set's gradient all-reduce in one step: the route its gradients take.

`run` is the funnel both replica paths of `GradientFlowAllReduce` go through:
the set's plan (`gf_tf.plan.plan_set`) and state (`gf_tf.state`), the settings
handshake (`gf_tf.agreement`), the `Communicator` over the planned algorithm
(`gf_tf.collectives`), then either TensorFlow's own all-reduce of every
gradient or the packs through the reducer (`gf_tf.reducers`) with the rest
(IndexedSlices, integers, float64, unknown shapes) through TensorFlow's own,
stitched back in the caller's order. A trial plan (`gf_tf.plan.trial`) runs
its two candidates here, eagerly, at the set's first trace. `run_merged` and
`run_in_replica` build the `Call` of each replica path, `run_locally` one with
the identity in place of every collective. TensorFlow's SUM is reached through
one door, `gf_tf.collectives.ring.tf_batch_sum`, by the step and the trial alike.
"""

import dataclasses
import logging
import zlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from gf_tf import agreement, collectives, packing, plan, slices, tf_internal, wire
from gf_tf.agreement import hex_text
from gf_tf.collectives import deadline as deadline_lib
from gf_tf.plan import trial
from gf_tf.reducers import MAX_REDUCER_SETTINGS, Communicator, PackStep, Reducer, Sent, StepInput
from gf_tf.state import StateRegistry, VariableSetState

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Orchestrator:
    """The parts of one GradientFlowAllReduce a route reads, passed in whole.

    cross_ops: the wrapped TF cross-device ops (None where nothing crosses a process:
    `GradientFlowAllReduce.reduce_locally`). workers: `gf_tf.cluster.WorkerInfo` or None
    (one worker, a MirroredStrategy). costs: the probe's `Costs` or None. settings and
    reducer: the GradientFlowAllReduce's. states: its StateRegistry. stats: its CommStats.
    trial_clock: the trial's clock (seconds).
    """
    cross_ops: Optional[tf.distribute.CrossDeviceOps]
    workers: object
    costs: Optional[plan.Costs]
    settings: plan.Settings
    reducer: Reducer
    states: StateRegistry
    stats: object
    trial_clock: Callable[[], float]

    @property
    def num_workers(self) -> int:
        return self.workers.num_workers if self.workers is not None else 1

    def plan_set(self, signature) -> plan.SetPlan:
        """`gf_tf.plan.plan_set` of a gradient signature under this orchestrator's settings."""
        return plan.plan_set(signature, self.settings, self.reducer, self.num_workers, self.costs)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the funnel. grads: per served replica, the caller's gradient list.
    replicas: the served replicas' indices among this worker's. tf_sum: TensorFlow's own
    SUM all-reduce of one 1-D tensor per served replica (`gf_tf.collectives.ring.tf_sum`).
    others(indices): the strategy's all-reduce (the caller's reduce_op) of those
    gradients, per index per served replica. gather_sum(values): the strategy's SUM of
    other values (per index, per served replica; `gf_tf.slices`' encoded rows). options:
    the caller's CommunicationOptions (the eager handshake and trial run with them); step_options: what the step's own
    collectives run with (`gf_tf.collectives.deadline.in_step_options`, no timeout: `deadline`,
    a StepWatch or None, keeps it)."""
    strategy: tf.distribute.Strategy
    grads: List[List]
    replicas: tuple
    variables: Sequence
    reduce_op: tf.distribute.ReduceOp
    tf_sum: Callable
    others: Callable
    gather_sum: Callable
    options: object
    step_options: object = None
    deadline: Optional[deadline_lib.StepWatch] = None


def run(orchestrator: Orchestrator, call: Call) -> List[List]:
    """Per served replica the reduced gradient list (packs through the reducer, the rest
    through `others`, one batch per dtype), counted in and out by the call's deadline."""
    grads = call.grads
    if call.deadline is not None:
        call.deadline.begin(grads)
    signature = [packing.packable_signature([g[i] for g in grads]) for i in range(len(grads[0]))]
    packable = [i for i, entry in enumerate(signature) if entry is not None]
    planned, signature, pack_specs = orchestrator.plan_set(signature)
    devices = list(call.strategy.extended.worker_devices)
    reducer = orchestrator.reducer
    # Before the reducer's state exists: a reducer may refuse this set (a rank that compresses
    # nothing), and a peer with other settings must then hear which setting differs.
    slices_16bit = slices_on_16bit_wire(orchestrator.settings, planned.plan,
                                        orchestrator.num_workers)
    if call.replicas[0] == 0 and orchestrator.workers is not None:
        agreement.check_workers_agree(orchestrator.workers,
                                      settings(signature, planned, reducer, slices_16bit),
                                      devices, orchestrator.cross_ops, call.options)
    state = orchestrator.states.get(list(call.variables), signature, pack_specs,
                                    lambda specs: reducer.create_states(specs, devices),
                                    lambda specs: reducer.create_hints(specs, devices))
    if state.planned != planned:
        state.planned = planned
        _log.info("gf_tf: variable set [%s] travels as %s", state.set_name,
                  plan.PlanReport(*planned).describe())
    comm = _communicator(orchestrator, call, planned.plan, devices)
    results = [[None] * len(signature) for _ in grads]
    choice = _choice(orchestrator, state, call, packable, comm, devices)
    if choice == trial.TF_OWN:
        sent = _sent_by_tf([grads[0][i] for i in packable])
        rest = list(range(len(signature)))   # every gradient by TF's own all-reduce
    else:
        sent = reduce_packs(orchestrator.reducer, state, grads, comm, results)
        rest = [i for i, entry in enumerate(signature) if entry is None]
    sparse = [i for i in rest if slices.encodable(grads[0][i])]
    encoded = sparse if slices_16bit else []
    reduce_by_tf(grads, [i for i in rest if i not in encoded], call.others, results)
    slices.reduce_16bit(grads, encoded, call.gather_sum,
                        call.reduce_op == tf.distribute.ReduceOp.MEAN,
                        call.strategy.num_replicas_in_sync, results)
    sent += slices.sent([grads[0][i] for i in sparse], encoded=bool(encoded))
    if (packable or sparse) and call.replicas[0] == 0:
        orchestrator.stats.update(**vars(sent))
    if call.deadline is not None:
        call.deadline.end(results)
    return results


def run_merged(orchestrator: Orchestrator, strategy, per_replica, variables, reduce_op,
               options) -> list:
    """`run` on the merge-call path: every local replica's gradients (`per_replica`: per
    gradient a PerReplica) -> per gradient a Mirrored value."""
    grads = [tf_internal.local_values(v) for v in per_replica]
    num_local = len(grads[0])
    tf_internal.check_not_xla_across_devices(num_local)
    step_options, watch = deadline_lib.for_step(strategy, options)

    def reduce(op, values):   # per value a distributed one -> per value its local results
        return [tf_internal.local_values(r) for r in strategy.extended.batch_reduce_to(
            op, [(v, v) for v in values], step_options)]

    results = run(orchestrator, Call(
        strategy, [[g[r] for g in grads] for r in range(num_local)], tuple(range(num_local)),
        variables, reduce_op, collectives.ring.tf_sum(orchestrator.cross_ops, step_options),
        lambda indices: reduce(reduce_op, [per_replica[i] for i in indices]),
        lambda values: reduce(tf.distribute.ReduceOp.SUM, map(tf_internal.per_replica, values)),
        options, step_options, watch))
    return [tf_internal.mirrored([results[r][i] for r in range(num_local)])
            for i in range(len(per_replica))]


def run_in_replica(orchestrator: Orchestrator, replica_ctx, grads, variables, reduce_op,
                   options) -> list:
    """`run` on the replica-context path: one replica's gradients -> its reduced gradients.

    Raises:
      ValueError: the replica id is not static while tracing.
    """
    num_local = len(replica_ctx.strategy.extended.worker_devices)
    replica_id = tf.get_static_value(replica_ctx.replica_id_in_sync_group)
    if replica_id is None:
        raise ValueError("gf_tf: the replica id is not known while tracing; the replica-context "
                         "gradient all-reduce needs a static one (tf.distribute strategies give it)")

    step_options, watch = deadline_lib.for_step(replica_ctx.strategy, options)

    def reduce(op, values):   # this replica's values -> per value [its result]
        return [[r] for r in replica_ctx.all_reduce(op, list(values), step_options)]

    tf_sum = collectives.ring.tf_sum(orchestrator.cross_ops, step_options, int(replica_id))
    served = (int(replica_id) % num_local,)
    return run(orchestrator, Call(
        replica_ctx.strategy, [list(grads)], served, variables, reduce_op, tf_sum,
        lambda indices: reduce(reduce_op, [grads[i] for i in indices]),
        lambda values: reduce(tf.distribute.ReduceOp.SUM, [v[0] for v in values]),
        options, step_options, watch))[0]


def run_locally(orchestrator: Orchestrator, strategy, grads, variables, reduce_op) -> list:
    """`run` for one replica (the strategy's first) with the identity in place of every
    collective (TF's SUM and the strategy's all-reduce of the rest): the step's local work."""
    grads = list(grads)
    return run(orchestrator, Call(strategy, [grads], (0,), variables, reduce_op,
                                  lambda tensors: list(tensors),
                                  lambda indices: [[grads[i]] for i in indices],
                                  lambda values: list(values), None))[0]


def _communicator(orchestrator: Orchestrator, call: Call, set_plan: plan.Plan,
                  devices) -> Communicator:
    context = collectives.Context(call.tf_sum, orchestrator.cross_ops, orchestrator.workers,
                                  tuple(devices[r] for r in call.replicas),
                                  len(call.replicas) == len(devices), call.step_options)
    return Communicator(collectives.get(set_plan.algorithm).build(context),
                        call.strategy.num_replicas_in_sync,
                        call.reduce_op == tf.distribute.ReduceOp.MEAN, call.replicas,
                        context.devices,
                        plan.latency_bytes(set_plan.algorithm, orchestrator.num_workers,
                                           orchestrator.costs))


def reduce_packs(reducer: Reducer, state: VariableSetState, grads, comm: Communicator,
                 results) -> Sent:
    """Hands the reducer the packs with elements (one record of the step) and writes their
    reduced values into `results`; an empty pack's values are zeros of their shapes."""
    specs = state.pack_specs
    live = [p for p, spec in enumerate(specs) if spec.num_elements]
    for pack in specs:
        if not pack.num_elements:
            for r in range(len(grads)):
                for i, shape, dtype in zip(pack.indices, pack.shapes, pack.dtypes):
                    results[r][i] = tf.zeros(shape, dtype)
    if not live:
        return Sent()
    step = StepInput(tuple(PackStep(specs[p], [[g[i] for i in specs[p].indices] for g in grads],
                                    state.pack_states[p], state.hints[p]) for p in live),
                     state.shared, comm, state.planned.plan.groups)
    outputs, sent = reducer.reduce(step)
    for pack, per_replica in zip(step.packs, outputs):
        for r, reduced in enumerate(per_replica):
            for i, value in zip(pack.spec.indices, reduced):
                results[r][i] = value
    return sent


def reduce_by_tf(grads, indices, others, results) -> None:
    """results[r][i] for i in `indices`: the wrapped TF ops' all-reduce, one batch per dtype."""
    for group in packing.groups_by_dtype(indices, [grads[0][i] for i in indices]):
        for i, reduced in zip(group, others(group)):
            for r, value in enumerate(reduced):
                results[r][i] = value


def slices_on_16bit_wire(set_settings: plan.Settings, set_plan: plan.Plan,
                         num_workers: int) -> bool:
    """Whether a set's float IndexedSlices travel as `gf_tf.slices`' 16-bit rows: where its
    packs are on a 16-bit wire, and under compression="auto" across workers whatever the
    packs' plan (the rows ride the same all-gather at half the bytes, so they cost no more than
    TensorFlow's float32 rows even where latency makes TF's own all-reduce the dense set's
    fastest). compression=None and a float32 wire keep them float32, as does one worker."""
    if set_plan.method != plan.TF_OWN and _wire_bytes(set_plan) == 2:
        return True
    return set_settings.compression == plan.AUTO and num_workers > 1


def _wire_bytes(set_plan: plan.Plan) -> int:
    """Bytes per element of the set's wire (4 for TensorFlow's own all-reduce)."""
    return 4 if set_plan.method == plan.TF_OWN else wire.format_of(set_plan.method).wire_bytes


def _sent_by_tf(grads) -> Sent:
    """What TF's own all-reduce of these gradients sends (its dtypes, float32 dense equivalent)."""
    elements = [int(g.shape.num_elements() or 0) for g in grads]
    return Sent(dense_bytes=4 * sum(elements),
                sent_bytes=sum(n * g.dtype.size for n, g in zip(elements, grads)))


def settings(signature, planned: plan.Planned, reducer: Reducer,
             slices_16bit: bool = False) -> List[agreement.Setting]:
    """The fields every worker must agree on, as (name, number, how to print it): the plan,
    whether IndexedSlices travel 16-bit, the gradients, the reducer's type and its own settings
    padded to MAX_REDUCER_SETTINGS (the handshake has a fixed width, so it cannot itself
    mismatch).

    Args:
      signature: per gradient its packable signature (shape, dtype) or None, as `run` has it.
      planned: the set's `gf_tf.plan.Planned`.
      slices_16bit: `slices_on_16bit_wire` of the set."""
    shapes = repr([None if s is None else (tuple(s[0].as_list()), s[1].name)
                   for s in signature]).encode()
    set_plan = planned.plan
    methods = (plan.TF_OWN,) + tuple(f.method for f in wire.FORMATS.values())
    algorithms = list(collectives.ALGORITHMS)
    own = list(reducer.settings())
    if len(own) > MAX_REDUCER_SETTINGS:
        raise ValueError(f"{type(reducer).__name__} declares {len(own)} handshake settings; "
                         f"at most {MAX_REDUCER_SETTINGS} fit the handshake")
    padding = [(f"reducer setting {k}", 0, lambda v: f"{v:g}")
               for k in range(len(own), MAX_REDUCER_SETTINGS)]
    return [
        ("compression", methods.index(set_plan.method), lambda c: _method_text(methods[int(c)])),
        ("bytes_per_pack", set_plan.bytes_per_pack, lambda b: str(int(b))),
        ("algorithm", algorithms.index(set_plan.algorithm), lambda a: repr(algorithms[int(a)])),
        ("overlap groups", set_plan.groups, lambda g: str(int(g))),
        ("trial against TensorFlow's own", int(set_plan.trial), lambda t: str(bool(t))),
        ("IndexedSlices on the 16-bit wire", int(slices_16bit), lambda t: str(bool(t))),
        ("number of gradients", len(signature), lambda n: str(int(n))),
        ("gradient shapes/dtypes (CRC32)", zlib.crc32(shapes), hex_text),
        ("reducer", _class_code(type(reducer)), _reducer_text),
    ] + own + padding


def _class_code(cls: type) -> int:
    """A reducer class as a handshake number: the CRC32 of its qualified name."""
    return zlib.crc32(cls.__qualname__.encode())


def _reducer_text(code) -> str:
    """How the handshake prints a reducer: the name of the loaded Reducer class (gf_tf's own and
    any this worker imported) with that code, else the code in hex."""
    classes, todo = {}, [Reducer]
    while todo:
        cls = todo.pop()
        classes[_class_code(cls)] = cls.__qualname__
        todo.extend(cls.__subclasses__())
    return classes.get(int(code), f"{hex_text(code)} (CRC32 of a class name not loaded here)")


def _method_text(method: str) -> str:
    """How the handshake prints a method: the compression name a user passes."""
    if method == plan.TF_OWN:
        return "'tf' (TensorFlow's own all-reduce)"
    return repr(wire.format_of(method).name)


def _choice(orchestrator: Orchestrator, state: VariableSetState, call: Call, packable,
            comm: Communicator, devices) -> int:
    """trial.TF_OWN or trial.GRADIENT_FLOW: how the set travels this step. Its plan's method;
    for a trial plan, the trial's decision, timed at the set's first trace where every local
    replica is served (the merge-call path), else the model's pick (the replica-context path:
    one replica a call; a reducer state the trial could not put back, `serializable`)."""
    set_plan = state.planned.plan
    if set_plan.method == plan.TF_OWN:
        return trial.TF_OWN
    if not set_plan.trial:
        return trial.GRADIENT_FLOW
    if len(comm.replicas) != len(devices) or not state.serializable:
        forecast = state.planned.forecast
        faster = forecast.seconds <= forecast.tf_seconds
        return trial.GRADIENT_FLOW if faster else trial.TF_OWN
    if state.trial is None:
        state.trial = _measure_trial(orchestrator, state,
                                     [[g[i] for i in packable] for g in call.grads],
                                     packable, comm, call.options)
    return state.trial.choice


def _measure_trial(orchestrator: Orchestrator, state: VariableSetState, grads, packable,
                   comm: Communicator, options) -> trial.Decision:
    """Runs the set's trial eagerly on tensors shaped like its packable gradients `grads`
    (per served replica), on their devices: TF's own all-reduce against the reducer's, both
    through TF's one SUM door (`gf_tf.collectives.ring.tf_batch_sum`). The reducer's state
    of the set is the same after it as before."""
    size = len(state.signature)
    tf_batch_sum = collectives.ring.tf_batch_sum(orchestrator.cross_ops, options)

    def as_gradient_list(inputs):   # per replica, the packable ones at their indices
        out = [[None] * size for _ in inputs]
        for r, replica in enumerate(inputs):
            for i, value in zip(packable, replica):
                out[r][i] = value
        return out

    def by_tf(indices, values):   # per index in `indices`, per replica: the SUM of values[r][i]
        return tf_batch_sum([[replica[i] for replica in values] for i in indices])

    @tf.function(autograph=False)   # AutoGraph would convert every gf_tf helper it calls
    def tf_own(inputs):
        values, out = as_gradient_list(inputs), [[None] * size for _ in inputs]
        reduce_by_tf(values, packable, lambda indices: by_tf(indices, values), out)
        return out

    @tf.function(autograph=False)   # AutoGraph would convert every gf_tf helper it calls
    def gradient_flow(inputs):
        out = [[None] * size for _ in inputs]
        reduce_packs(orchestrator.reducer, state, as_gradient_list(inputs), comm, out)
        return out

    def mean(mine):
        return collectives.sum_over_workers(collectives.ring.tf_sum(orchestrator.cross_ops, options),
                                            comm.devices, mine) / orchestrator.num_workers

    with tf.init_scope():
        inputs = []
        for device, replica in zip(comm.devices, grads):
            with tf.device(device):
                inputs.append([tf.fill(g.shape, tf.constant(1e-3, g.dtype)) for g in replica])
        # The trial's runs of the reducer are not steps: a stateful reducer's state (a counter,
        # a residual) is put back as it was.
        before = state.to_arrays()
        decision = trial.measure([lambda: tf_own(inputs), lambda: gradient_flow(inputs)], mean,
                                 state.set_name, orchestrator.trial_clock)
        if before:
            state.assign_arrays(before)
        return decision
