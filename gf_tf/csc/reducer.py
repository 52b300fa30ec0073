"""The CSC step: the reducer of `gf_tf.reducers` for `ChunkSparsity` (algorithm: `gf_tf.csc`)."""

import dataclasses
import logging
import warnings
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from gf_tf import ops
from gf_tf.agreement import hex_text
from gf_tf.csc import auto, buffers, dense_sets, selection
from gf_tf.csc.density import MIN_CHUNKS
from gf_tf.csc.state import CSCSetState
from gf_tf.reducers import (Communicator, CostTerms, DenseReducer, PackStep, Reducer, Sent,
                            StepInput, for_each_group, wire_scales)

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Accumulated:
    """A pack's accumulator, per served replica: acc = residual + (u or g) float32 [n], its
    local chunk L1 norms float32 [C] (before the all-reduce), the new velocity u (or None),
    and the local chunk L1 norms of acc + momentum * u, float32 [C], where the policy
    `wants_lookahead` and the pack keeps a velocity (else None)."""
    accs: List[tf.Tensor]
    norms: List[tf.Tensor]
    new_us: List[Optional[tf.Tensor]]
    lookaheads: List[Optional[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class ReplicaSend:
    """What one served replica sends of one pack, and what it commits once the step is finite.

    buffer: the selected chunks on the wire (padded to the static length unless its
      indices came from a group's top K); size: its length (int, or int32 scalar);
    idx: int32 selected chunk indices, ascending; finite: bool scalar, the
      all-reduced norms are finite; postscale: undoes the prescale (and MEAN);
    updates: (variable, new value) pairs: residual, velocity;
    norm: the all-reduced chunk norms (float32 [C]).
    """
    buffer: tf.Tensor
    size: Any
    idx: tf.Tensor
    finite: tf.Tensor
    postscale: Any
    updates: Tuple[Tuple[tf.Variable, tf.Tensor], ...]
    norm: tf.Tensor


@dataclasses.dataclass(frozen=True)
class PackSend:
    """One pack's sends per served replica, and its residual L1 norm after the step."""
    replicas: List[ReplicaSend]
    residual_l1: tf.Tensor


class Branch(NamedTuple):
    """What one candidate's branch of the step returns (a nest for tf.switch_case).

    outputs: the reduced tensors, pack by pack, served replica by replica;
    sent_bytes, selected_chunks: int64 scalars of the plan; residual_l1: float32;
    started, done: per served replica the auto clocks (empty without auto);
    figures: the policy's per-step counts by name (`SelectionPolicy.figures`, int64 scalars).
    """
    outputs: List[tf.Tensor]
    sent_bytes: tf.Tensor
    selected_chunks: tf.Tensor
    residual_l1: tf.Tensor
    started: List[tf.Tensor]
    done: List[tf.Tensor]
    figures: Dict[str, tf.Tensor]


class GroupResult(NamedTuple):
    """One group's step: its Branch, its packs' specs and chunk counts, the candidates'
    plans and the candidate index (int32 scalar or a Python 0)."""
    result: "Branch"
    specs: List[Any]
    counts: List[int]
    plans: List[Any]
    index: Any


class CSCReducer(Reducer):
    """Top-k chunks of residual + gradient, all packs of a set in one collective per wire dtype.

    The choices are the settings' objects: `policy` (the selection policy, a
    `gf_tf.csc.selection.SelectionPolicy`) and `density_rule` (`gf_tf.csc.density`).

    clock: density="auto"'s clock, clock(replica, event) -> float64 scalar
      seconds, event "ready" (the replica's gradients are ready), "send" (its
      chunk all-reduce can start) or "done" (it ended); tf.timestamp() by default.
      Tests replace it (before the first trace) to feed known figures.
    """

    TIMING_FIGURES = auto.TIMING_FIGURES

    def __init__(self, sparsity):
        self.sparsity = sparsity
        self.policy = sparsity.policy
        self.density_rule = sparsity.density_rule
        self.clock = auto.timestamp
        self.warned = False   # the few-chunks warning, once per reducer
        self.dense = DenseReducer()   # for sets CSC never compresses (`gf_tf.csc.dense_sets`)

    @property
    def selection(self):
        """Deprecated name of `policy`."""
        warnings.warn("CSCReducer.selection is deprecated: use CSCReducer.policy",
                      DeprecationWarning, stacklevel=2)
        return self.policy

    def create_states(self, packs, devices):
        if not packs:
            return None, []
        shared = CSCSetState(packs[0].key.replace("/", "_"), len(devices),
                             self.density_rule.measures)
        return shared, [self.policy.create_state(
            pack.key.replace("/", "_"), pack.num_elements,
            ops.num_chunks(pack.num_elements, self.sparsity.chunk_size), devices,
            self.sparsity.momentum > 0.0, shared.steps) for pack in packs]

    def create_hints(self, packs, devices):
        if dense_sets.never_compressed(self.sparsity, packs):
            return self.dense.create_hints(packs, devices)
        return [None] * len(packs)

    default_method = "fp16"   # compression="auto" with CSC: FP16 chunks

    def settings(self):
        """The density (-1 for "auto") and a CRC32 of every ChunkSparsity setting."""
        config = (type(self.sparsity).__name__, sorted(self.sparsity.get_config().items()))
        return [("sparsity density", self.density_rule.code, density_text),
                ("sparsity settings (CRC32)", zlib.crc32(repr(config).encode()), hex_text)]

    def state_settings(self):
        """What the residuals, velocities, scores and step counters mean: the chunk size, the
        momentum (correction) and the selection policy. The density, its rule and the warm-up
        only choose what a step sends, so a checkpoint restores across them."""
        from gf_tf.csc import policies  # pylint: disable=import-outside-toplevel  # it imports the policies
        names = {zlib.crc32(name.encode()): name for name in policies.POLICIES}
        return [("sparsity chunk_size", self.sparsity.chunk_size, lambda v: str(int(v))),
                ("sparsity momentum", self.sparsity.momentum, lambda v: f"{v:g}"),
                ("sparsity selection (CRC32)", zlib.crc32(self.sparsity.selection.encode()),
                 lambda v: repr(names[int(v)]) if int(v) in names else hex_text(v))]

    def cost(self, elements, wire_format):
        """Two collectives a step: the chunk norms, then the selected chunks (one with
        selection="ahead"); groupable at a fixed density with per-pack or "ahead" selection
        (`ChunkSparsity.overlaps`)."""
        return CostTerms(self.sparsity.step_bytes(elements, wire_format.wire_bytes),
                         groupable=self.sparsity.overlaps)

    def reduce(self, step: StepInput):
        """The packs share the schedule and step counter, so one `tf.switch_case` over
        the candidates' plans (schedule stages; with density="auto" the warm-up
        stages and the rungs) picks every pack's k at once.

        With `step.groups` > 1 (`ChunkSparsity.overlaps`: per-pack selection, a fixed
        density) each group of packs (`for_each_group`) all-reduces its own norms,
        then its own chunks, under the name scope "gf_group<g>", so its collectives wait
        only for its own gradients; the candidate index (the step counter's stage) is the
        same for every group. Per-pack top k depends on the pack's own norms only, so
        the sums and residuals are those of one barrier, bit for bit. A set CSC never
        compresses travels as the dense reducer's packs (`gf_tf.csc.dense_sets`).
        """
        if dense_sets.never_compressed(self.sparsity, [pack.spec for pack in step.packs]):
            return dense_sets.reduce(step, self.dense, self.sparsity.chunk_size)
        comm = step.comm
        index = None

        def group(g, packs):
            nonlocal index
            part = self._reduce_group(step, packs, index)
            index = part.index
            return part

        parts = for_each_group(step, group)
        with tf.device("/cpu:0"):
            density = tf.gather(tf.constant([plan.density for plan in parts[0].plans], tf.float64),
                                index)
            for r in comm.replicas:
                step.shared.steps[r].assign_add(1)
            self.density_rule.record(step.shared, comm, parts[0].result)
        sent = Sent(dense_bytes=4 * sum(pack.spec.num_elements for pack in step.packs),
                    sent_bytes=tf.add_n([part.result.sent_bytes for part in parts]),
                    selected_chunks=tf.add_n([part.result.selected_chunks for part in parts]),
                    total_chunks=sum(sum(part.counts) for part in parts),
                    residual_norm=tf.add_n([part.result.residual_l1 for part in parts]),
                    density=density,
                    figures={name: tf.add_n([part.result.figures[name] for part in parts])
                             for name in self.policy.figures})
        outputs = [per_pack for part in parts
                   for per_pack in _per_pack(part.result.outputs, part.specs, len(comm.replicas))]
        return outputs, sent

    def _reduce_group(self, step: StepInput, packs, index) -> "GroupResult":
        """One group of packs (all of them with one barrier): their norms' all-reduce (with
        the density="auto" figures), the candidate index (`index`, or chosen here when None:
        the first group's), and the switch_case over the candidates' plans."""
        comm, cs = step.comm, self.sparsity.chunk_size
        specs = [pack.spec for pack in packs]
        counts = [ops.num_chunks(spec.num_elements, cs) for spec in specs]
        timing = self.density_rule.figures(step.shared, self.clock, [p.grads for p in packs], comm)
        accumulated = [self._accumulate(pack, comm) for pack in packs]
        timing, norms = self.policy.controls(comm, timing, accumulated)
        groups = selection.wire_groups(specs)
        control_bytes = 4 * int(timing[0].shape[0])
        rule = self.density_rule
        plans = [selection.plan_step(specs, counts, groups, cs, self.policy, first, density,
                                     control_bytes, rule.min_chunks if first is None else 1)
                 for first, density in self.sparsity.candidates()]
        if not rule.measures and not self.warned:
            self.warned = _warn_few_chunks(plans[-1], counts)
        if index is None:
            index = self._plan_index(plans, step, timing)
        branches = list(dict.fromkeys(plan.ks for plan in plans))
        first_plan = {ks: next(p for p in plans if p.ks == ks) for ks in branches}
        group_step = dataclasses.replace(step, packs=tuple(packs))

        def branch(plan):
            def run():
                outputs, residual_l1, started, done, *counted = self.policy.step(
                    self.chunk_step, self.sparsity, group_step, counts, accumulated, norms, plan)
                counted = counted[0] if counted else {}
                figures = {name: tf.cast(counted.get(name, 0), tf.int64)
                           for name in self.policy.figures}
                return Branch(outputs, tf.constant(plan.sent_bytes, tf.int64),
                              tf.constant(plan.selected_chunks, tf.int64), residual_l1, started,
                              done, figures)
            return run

        if len(branches) == 1:
            result = branch(plans[0])()
        else:
            with tf.device("/cpu:0"):
                which = tf.gather([branches.index(plan.ks) for plan in plans], index)
            result = tf.switch_case(which, [branch(first_plan[ks]) for ks in branches])
        return GroupResult(result, specs, counts, plans, index)

    def _plan_index(self, plans, step: StepInput, timing):
        """int32 index into `plans` for this step (a Python 0 when there is one)."""
        if len(plans) == 1:
            return 0
        staged = [plan.first_step for plan in plans if plan.first_step is not None]
        with tf.device("/cpu:0"):
            current = step.shared.steps[step.comm.replicas[0]].read_value()
            stage = tf.reduce_sum(tf.cast(current >= tf.constant(staged, tf.int64), tf.int32)) - 1
            return self.density_rule.index(stage, current, plans, timing[0], step.comm,
                                           self.sparsity.warmup_steps, step.shared)

    def _accumulate(self, pack: PackStep, comm: Communicator) -> Accumulated:
        state = pack.state
        lookahead = bool(state.velocities) and self.policy.wants_lookahead(self.sparsity)

        def accumulate(r, g):
            u = state.velocities[r] if state.velocities else None
            acc, norms, new_u, *ahead = ops.accumulate(
                state.residuals[r], g, self.sparsity.chunk_size, u, self.sparsity.momentum,
                lookahead)
            return acc, norms, new_u, (ahead[0] if ahead else None)

        accs, norms, new_us, lookaheads = zip(*comm.map(accumulate, pack.grads))
        return Accumulated(list(accs), list(norms), list(new_us), list(lookaheads))

    def chunk_step(self, step: StepInput, counts, accumulated, norms, plan):
        """One step of a group of packs at `plan` (a `selection.StepPlan`) from the
        all-reduced chunk `norms` (per pack, per served replica float32 [C]): every pack
        sends its k chunks (the policy's `select`; None: all, a dense step), or its share of
        its wire group's top K (`selection.group_shares`).

        Returns:
          (outputs: the reduced tensors, pack by pack, served replica by replica;
          residual_l1: float32 scalar; started, done: per served replica the density rule's
          clocks, or []).
        """
        comm = step.comm
        picks = [None] * len(step.packs)
        for group in plan.groups:
            if group.top_k is not None:
                shares = selection.group_shares([counts[j] for j in group.members],
                                                [norms[j] for j in group.members],
                                                group.top_k, comm)
                for j, share in zip(group.members, shares):
                    picks[j] = share
        sends = [self._gather(*args, comm)
                 for args in zip(step.packs, accumulated, norms, plan.ks, picks)]
        received, started, done = self._exchange(plan, sends, comm)
        outputs, residual_l1 = [], 0.0
        for pack, send, parts, k in zip(step.packs, sends, received, plan.ks):
            outputs.extend(self._scatter(pack, send, parts, k, comm))
            residual_l1 += send.residual_l1
        return outputs, residual_l1, started, done

    def _exchange(self, plan, sends: List[PackSend], comm: Communicator):
        """The chunk all-reduce of each wire group: (per pack, per served replica its
        received chunks; the auto "send" and "done" clocks per served replica, or [])."""
        received = [[None] * len(comm.replicas) for _ in sends]
        reduced, started = [[] for _ in comm.replicas], []
        for group in plan.groups:
            wire_buffers = [buffers.pad_to(tf.concat([sends[j].replicas[i].buffer
                                                      for j in group.members], 0), group.length)
                            for i in range(len(comm.replicas))]
            if not started:   # the start of this step's chunk all-reduce
                wire_buffers, started = self.density_rule.clocked(wire_buffers, self.clock, comm)
            fused = comm.all_reduce_sum(wire_buffers)
            for i, buffer in enumerate(fused):
                reduced[i].append(buffer)
                with tf.device(buffer.device):
                    sizes = [sends[j].replicas[i].size for j in group.members]
                    for j, part in zip(group.members, tf.split(buffer, sizes + [-1])):
                        received[j][i] = part
        done = self.density_rule.done_clocks(reduced, self.clock, comm)
        return received, started, done

    def _gather(self, pack: PackStep, accumulated: Accumulated, norms, k, picks,
                comm: Communicator) -> PackSend:
        """The pack's chunks to send, per served replica: idx from `picks` (per replica, a
        group's top K: unpadded, run-time sizes) or its own top k (padded to the static
        length k*chunk_size; k None: every chunk)."""
        spec, state, cs = pack.spec, pack.state, self.sparsity.chunk_size
        length = spec.num_elements if k is None else k * cs

        def send(r, acc, norm, new_u, pick):
            finite = tf.reduce_all(tf.math.is_finite(norm))
            if pick is not None:
                idx = pick
            elif k is None:
                idx = tf.range(ops.num_chunks(spec.num_elements, cs), dtype=tf.int32)
            else:
                idx = self.policy.select(norm, k)
            prescale, postscale = wire_scales(spec.wire, comm,
                                                       lambda: tf.gather(norm, idx))
            selected, new_residual, masked_u = ops.gather_chunks(
                acc, idx, cs, spec.wire_dtype, prescale, new_u if k is not None else None)
            if pick is None:
                # Static wire shape on every step: pad a selected partial last chunk.
                selected = buffers.pad_to(selected, length)
            updates = [(state.residuals[r], new_residual)]
            if state.velocities:
                updates.append((state.velocities[r], new_u if k is None else masked_u))
            return ReplicaSend(selected, length if pick is None else tf.size(selected), idx,
                               finite, postscale, tuple(updates), norm)

        replicas = comm.map(send, accumulated.accs, norms, accumulated.new_us,
                            picks if picks is not None else [None] * len(comm.replicas))
        first = replicas[0]
        return PackSend(replicas, buffers.record_residual_l1(
            state, accumulated.norms[0], first.idx, first.finite, comm))

    def _scatter(self, pack: PackStep, send: PackSend, parts, k, comm) -> List[tf.Tensor]:
        """The pack's tensors from its received chunks, served replica by replica (flat);
        commits the state where the step is finite."""
        spec, cs = pack.spec, self.sparsity.chunk_size

        def scatter(r, part, sent: ReplicaSend):
            m = (spec.num_elements if k is None
                 else buffers.selected_length(spec.num_elements, cs, sent.idx))
            out = ops.scatter_chunks(part[:m], sent.idx, cs, spec.shapes, spec.dtypes,
                                     sent.postscale)
            updates = sent.updates + self.policy.dense_updates(pack.state, r, part[:m],
                                                               sent.postscale, sent.norm, comm, cs)
            buffers.assign_if(sent.finite, updates)
            return out

        return [t for tensors in comm.map(scatter, parts, send.replicas) for t in tensors]


def _warn_few_chunks(plan, counts) -> bool:
    """Logs a warning (and returns True) when the final density sends fewer than MIN_CHUNKS
    chunks of a sparse pack per step (each chunk then waits about C / k steps for its turn)."""
    few = [(k, c) for k, c in zip(plan.ks, counts) if k is not None and k < MIN_CHUNKS]
    if few:
        k, c = min(few, key=lambda kc: kc[0] / kc[1])
        _log.warning("gf_tf: ChunkSparsity(density=%g) sends %d of a pack's %d chunks per step, "
                     "fewer than %d: each chunk waits about %d steps to be sent, which can cost "
                     "accuracy on a small model. density=\"auto\" keeps at least %d chunks a "
                     "step and sends dense where compressing does not pay (docs/csc.md).",
                     plan.density, k, c, MIN_CHUNKS, -(-c // k), MIN_CHUNKS)
    return bool(few)


def _per_pack(flat, specs, num_replicas):
    """The flat outputs (pack by pack, replica by replica) -> per pack, per replica a list."""
    out, i = [], 0
    for spec in specs:
        size = len(spec.shapes)
        out.append([list(flat[i + r * size:i + (r + 1) * size]) for r in range(num_replicas)])
        i += size * num_replicas
    return out


def density_text(code) -> str:
    """How the handshake prints a density code: "auto" for -1, else the fraction."""
    return "auto" if code < 0 else f"{code:g}"
