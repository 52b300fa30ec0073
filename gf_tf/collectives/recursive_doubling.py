"""A latency-optimal SUM all-reduce across workers from TensorFlow's subgroup collectives.

TensorFlow's ring all-reduce (CollectiveAllReduce, RING) takes 2(N-1) hops
per collective, so a small all-reduce (FP16 scale bounds, CSC chunk norms, a
few selected chunks) at N workers costs 2(N-1) hop latencies. Recursive
doubling takes ceil(log2 N) rounds: in round k every rank all-reduces with
partner rank XOR 2^k (a 2-member `collective_ops.all_reduce_v2`). For N not a
power of two, with P the largest power of two <= N, each extra rank r >= P
first sends its value to r - P, which adds it (fold); the P ranks double; then
r - P sends the total back to r (unfold). Fold and unfold are 2-member
broadcasts (`broadcast_send_v2` / `broadcast_recv_v2`): one hop each, where a
2-member all-reduce is two (reduce-scatter, then all-gather), and the unfold
is an exact copy (bfloat16, which TF's broadcasts do not take, travels as its
bits in a float16 tensor).

Source: recursive doubling and the non-power-of-two fold, Thakur, Rabenseifner
& Gropp 2005, "Optimization of collective communication operations in MPICH"
(IJHPCA 19(1)), section 4.

Keys and order (every worker must issue the same collectives in the same
order, or the job hangs until the timeout):
- Group keys are a pure function of (stage, lower rank of the pair):
  GROUP_KEY_BASE + stage * MAX_WORKERS + low, stage 0 the fold, 1..L the
  rounds, L + 1 the unfold. TensorFlow's CollectiveKeys count up from
  1 + the strategy's collective key base (0 outside TF's own tests), so they
  stay far below GROUP_KEY_BASE.
- Each all-reduce draws ONE instance key from the wrapped CollectiveAllReduce's
  own allocator (its first local replica's launcher, at call time inside a
  tf.function, as TF's own collectives do) on EVERY worker, whatever its part
  in the schedule; all its stages use that key in their own groups. TF's
  counter thus advances identically on every worker, and the collectives TF
  issues afterwards keep matching keys.
- `schedule(N, rank)` is a pure function of N and the rank: within a stage
  each rank has at most one partner, and that partner lists the same stage
  with the matching action. Each worker runs its stages in increasing order,
  so a stage waits only on stages below it: no cycle, no deadlock.
- The 2-member all-reduces carry the launcher's ordering token, so on each
  worker they run in program order with TensorFlow's own collectives; the
  broadcasts are chained by data and control dependencies.
Calls themselves come in the same order on every worker because every worker
traces the same step (the model, the pack plan, the algorithm and the overlap
groups are compared by GradientFlowAllReduce's settings handshake). With
overlap groups (gf_tf.reducers.base) a group's bounds and packs are calls like any
other, in pack order; a later group's broadcasts (fold, unfold) carry no token
and may run before an earlier group's, which is safe: they are matched by
their own instance key, and every dependency (the token chain, data within a
call) goes from an earlier (call, stage) to a later one on every worker.

Private TensorFlow names (the launcher, its instance keys, ordering token and
options) are reached through `gf_tf.tf_internal`.
"""

import dataclasses
import math
from typing import Callable, List, Sequence

import tensorflow as tf

from gf_tf import tf_internal

GROUP_KEY_BASE = 0x47460000   # "GF" in the high bytes: 1,195,769,856
MAX_WORKERS = 1 << 16         # room per stage; 18 stages stay below 2**31

# Actions of one rank in one stage.
SEND = "send"                 # broadcast my value to the partner (fold: extra; unfold: r - P)
RECEIVE_ADD = "receive_add"   # fold, r - P: receive the extra's value and add it
ALL_REDUCE = "all_reduce"     # a doubling round: 2-member SUM all-reduce
RECEIVE = "receive"           # unfold, the extra: the total replaces my value


@dataclasses.dataclass(frozen=True)
class Step:
    """One stage of one rank: with whom, doing what (see the module docstring)."""
    stage: int
    partner: int
    action: str

    def group_key(self, rank: int) -> int:
        return GROUP_KEY_BASE + self.stage * MAX_WORKERS + min(rank, self.partner)


def schedule(num_workers: int, rank: int) -> List[Step]:
    """The steps of `rank` (0 .. num_workers-1) in recursive doubling over `num_workers`.

    Raises ValueError for a rank out of range or more than MAX_WORKERS workers.
    """
    if not 0 <= rank < num_workers <= MAX_WORKERS:
        raise ValueError(f"recursive doubling: rank {rank} of {num_workers} workers "
                         f"(1 to {MAX_WORKERS} workers)")
    p = 1 << (num_workers.bit_length() - 1)    # the largest power of two <= num_workers
    rounds = p.bit_length() - 1
    if rank >= p:
        return [Step(0, rank - p, SEND), Step(rounds + 1, rank - p, RECEIVE)]
    has_extra = rank + p < num_workers
    steps = [Step(0, rank + p, RECEIVE_ADD)] if has_extra else []
    steps += [Step(1 + k, rank ^ (1 << k), ALL_REDUCE) for k in range(rounds)]
    return steps + ([Step(rounds + 1, rank + p, SEND)] if has_extra else [])


def recursive_doubling_sum(cross_ops: tf.distribute.CrossDeviceOps, workers,
                           devices: Sequence[str], options=None
                           ) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """A SUM all-reduce over all replicas of all workers by recursive doubling across workers.

    The callable has the contract of `gf_tf.reducers.Communicator.all_reduce_sum`:
    it takes one 1-D tensor per served replica (`devices`, in order; float16,
    bfloat16 or float32, the same shape and dtype on every replica of every
    worker; a 0-element tensor is allowed and needs no collective) and
    returns per served replica, on its device, the SUM over all replicas of
    all workers, with the same shape and dtype. Several local replicas are
    first summed on `devices[0]` (in replica order), the sum travels once,
    and a copy goes back to each device. Every worker ends with the same bits.
    Call it in the same order on every worker (see the module docstring).

    Args:
      cross_ops: the strategy's `CollectiveAllReduce` (MultiWorkerMirroredStrategy):
        its first local replica's launcher gives the instance keys, the
        ordering token and the default CommunicationOptions.
      workers: `gf_tf.cluster.WorkerInfo` (rank, number of workers).
      devices: the served replicas' devices: all local replicas of this worker.
      options: `tf.distribute.experimental.CommunicationOptions` or None;
        merged over `cross_ops`' own. Its `timeout_seconds` bounds every
        collective, so a lost peer fails with DeadlineExceededError (or
        TensorFlow's peer-failure error) instead of hanging.

    Raises:
      ValueError: cross_ops is not a CollectiveAllReduce; no devices; a bad
        rank; (on call) not one tensor per device.
    """
    if not devices:
        raise ValueError("recursive_doubling_sum needs the served replicas' devices")
    launcher = tf_internal.collective_launcher(cross_ops)
    merged = tf_internal.merged_collective_options(cross_ops, options)
    steps = schedule(workers.num_workers, workers.rank)
    devices = tuple(devices)

    def all_reduce_sum(tensors: List[tf.Tensor]) -> List[tf.Tensor]:
        if len(tensors) != len(devices):
            raise ValueError(f"recursive doubling: {len(tensors)} tensors for "
                             f"{len(devices)} replica devices")
        with tf.device(devices[0]):
            total = tensors[0] if len(tensors) == 1 else tf.add_n(list(tensors))
            if total.shape.num_elements() != 0:   # the same shape on every worker
                instance_key = tf_internal.next_instance_key(launcher)
                token = tf_internal.ordering_token(launcher)
                for step in steps:
                    total = _run_step(step, workers.rank, total, instance_key, token, merged)
        out = []
        for device in devices:
            with tf.device(device):
                out.append(tf.identity(total))
        return out

    return all_reduce_sum


def _run_step(step: Step, rank: int, value: tf.Tensor, instance_key, token, options) -> tf.Tensor:
    """`value` after `step` (ops on the current device)."""
    group_key = step.group_key(rank)
    timeout = options.timeout_seconds or 0
    if step.action == ALL_REDUCE:
        return tf_internal.pair_all_reduce(value, group_key, instance_key,
                                           options.implementation.value, timeout, token)
    # TF's broadcasts take no bfloat16: its bits travel as float16 (a copy, never arithmetic).
    carrier = tf.float16 if value.dtype == tf.bfloat16 else value.dtype
    if step.action == SEND:
        sent = tf_internal.pair_broadcast_send(tf.bitcast(value, carrier), group_key,
                                               instance_key, timeout)
        return tf.bitcast(sent, value.dtype)
    with tf.control_dependencies([value]):   # after this rank's earlier stages
        received = tf_internal.pair_broadcast_recv(tf.shape(value), carrier, group_key,
                                                   instance_key, timeout)
    received = tf.bitcast(tf.ensure_shape(received, value.shape), value.dtype)
    return value + received if step.action == RECEIVE_ADD else received


def rounds(workers: int) -> int:
    """Rounds of one all-reduce over `workers` (0 for 1): log2 of the largest power of two
    <= workers, plus the fold and the unfold when workers is not a power of two."""
    if workers <= 1:
        return 0
    power = int(math.floor(math.log2(workers)))
    return power + (0 if 2 ** power == workers else 2)


def build(context) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """The algorithm's all_reduce_sum for `context` (`gf_tf.collectives.Context`): recursive
    doubling where several workers take part and every local replica is served (it sums
    them before its rounds), else the wrapped TF ops' ring."""
    workers = context.workers
    if workers is None or workers.num_workers <= 1 or not context.all_replicas:
        return context.tf_sum
    return recursive_doubling_sum(context.cross_ops, workers, context.devices, context.options)
