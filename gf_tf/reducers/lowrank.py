"""Low-rank gradient compression (PowerSGD): the matrices of a step travel as two thin factors.

Each matrix-shaped gradient M (2-D, or a kernel reshaped to [fan-in, fan-out]: all dimensions
but the last by the last; n x m) of replica r, plus that replica's residual, is compressed by
one step of power iteration with a warm-started Q (float32 [m, rank], equal on every replica):

    P_r = M_r Q;  P = SUM_r P_r        (one all-reduce for the P's of all matrices of the step)
    P^  = orthogonalise(P)             (modified Gram-Schmidt in float32, the same on every replica)
    Q_r = M_r^T P^
    Q'  = SUM_r Q_r                    (one all-reduce for the Q's)
    out = P^ Q'^T (Q' times 1/N for MEAN); residual_r = M_r - P^ Q_r^T; Q = Q' for the next step.

This form reads each matrix three times a step, in the three passes of `gf_tf.ops` (compiled
kernels on the CPU): `lowrank_project` (M_r, P_r and M_r's largest column norm),
`lowrank_project_back` (Q_r) and `lowrank_reconstruct` (out and residual_r).

The residual is each replica's own share of what the approximation missed (error feedback,
Vogels et al.'s Algorithm 2), so the residuals of all replicas add up to SUM_r M_r - P^ Q'^T.
Tensors that would not shrink by `min_compression` ((n + m) rank > n m / min_compression:
biases, small layers) travel as dense packs through `gf_tf.reducers.DenseReducer.reduce_pack`.

On a scaled wire (FP16) every factor is multiplied by a power of two from an all-reduced bound
(`wire_scales`), as packs are. P_r is computed before the control all-reduce, so its bound is
its own max |P_r|; |Q_r| <= max column norm of M_r (P^'s columns have unit norm), the one bound
that reads M. The bounds of the P's, the Q's and the dense packs travel in the step's one control
all-reduce (`fuse_controls`); each factor's scale comes from the SUM over the N replicas of its
bound, which bounds every partial sum of the all-reduce, so no partial sum can overflow.

`LowRank(alternate=True)` sends one factor a step instead, the P's and the Q's in turn
(ACP-SGD, `gf_tf.reducers.alternating`): one factor all-reduce per step.

A step whose all-reduced factors or dense tensors hold inf or NaN returns them (the loss-scale
optimizer then skips it on every worker: the all-reduced values are the same everywhere) and
leaves Q and the residuals unchanged: the state is written in one branch on the step's finite
flag.

Warm-up (`warmup_steps`): the first steps that all-reduce finite values are dense, the whole
packs on their wire as the dense reducer sends them (`DenseReducer.reduce`); Q keeps its first
value and the residuals stay zero. The count (`LowRankSetState.steps`) moves together on every
worker, so every worker switches at the same step (one `tf.cond` over the step).

Source: Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithms 1 and 2; PyTorch's `powerSGD_hook`
(`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`: warm start, `min_compression_rate`,
`start_powerSGD_iter`).
"""

import dataclasses
import math
from typing import List, Tuple

import tensorflow as tf

from gf_tf import ops, wire
from gf_tf.checks import is_int_at_least, is_number_in
from gf_tf.packing import PackSpec
from gf_tf.reducers.alternating import alternate_factors
from gf_tf.reducers.base import (CostTerms, PackStep, Reducer, Sent, StepInput, fuse_controls,
                                 no_control, wire_scales)
from gf_tf.reducers.dense import DenseReducer
from gf_tf.reducers.factors import (Layout, LowRankSetState, LowRankState, Matrix, initial_factor,
                                    dense_part, largest_norm, matrix_shape, orthogonalise,
                                    residual_commits)

# Dense steps before compression starts (LowRank's docstring: why 50).
DEFAULT_WARMUP_STEPS = 50

__all__ = ["DEFAULT_WARMUP_STEPS", "Layout", "LowRank", "LowRankSetState", "LowRankState",
           "initial_factor", "matrix_shape", "orthogonalise"]


class LowRank(Reducer):
    """Rank-`rank` power-iteration compression with warm start and error feedback (PowerSGD).

    Args:
      rank: int >= 1, the columns of P and Q; a step sends (n + m) rank factor elements for each
        compressed n x m matrix instead of n m.
      min_compression: number >= 1: a matrix is compressed only when n m >= min_compression
        (n + m) rank; the others travel dense on the pack's wire. PyTorch's
        `min_compression_rate`, 2 by default there too.
      seed: int >= 0, the seed of the first Q (`initial_factor`), equal on every worker.
      alternate: bool: False, two factor all-reduces per step (PowerSGD); True, one, the P's and
        the Q's in turn (ACP-SGD, `gf_tf.reducers.alternating`), each step sending n rank or
        m rank elements per compressed matrix.
      warmup_steps: int >= 0, the dense steps (optimizer steps with finite gradients) before
        compression starts: PyTorch's `start_powerSGD_iter`, whose documentation advises about
        10% of the training's steps. DEFAULT_WARMUP_STEPS (50) is that share of a run of a few
        hundred steps, and CSC's warm-up in `models.train`.

    Raises:
      ValueError: a setting out of range, naming the setting and its accepted values.

    The module docstring (`gf_tf.reducers.lowrank`) gives the step. Two all-reduces per step
    carry the factors (the P's of every matrix, then the Q's, one buffer per wire format; one
    with `alternate`), plus the dense remainder's packs and, on a scaled wire, one control
    all-reduce; a warm-up step issues the dense reducer's collectives instead.
    """

    def __init__(self, rank: int = 2, min_compression: float = 2.0, seed: int = 0,
                 alternate: bool = False, warmup_steps: int = DEFAULT_WARMUP_STEPS):
        if not is_int_at_least(rank, 1):
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not is_number_in(min_compression, 1.0, math.inf, high_open=True):
            raise ValueError(f"min_compression must be a finite number >= 1 (compress an n x m "
                             f"matrix only when n*m >= min_compression*(n+m)*rank), got "
                             f"{min_compression!r}")
        if not is_int_at_least(seed, 0):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(alternate, bool):
            raise ValueError(f"alternate must be True or False, got {alternate!r}")
        if not is_int_at_least(warmup_steps, 0):
            raise ValueError(f"warmup_steps must be an integer >= 0 (dense steps before "
                             f"compression starts), got {warmup_steps!r}")
        self.rank, self.min_compression, self.seed = int(rank), float(min_compression), int(seed)
        self.alternate, self.warmup_steps = alternate, int(warmup_steps)

    def compresses(self, n: int, m: int) -> bool:
        """An n x m matrix shrinks by at least `min_compression` at this rank."""
        return n * m >= self.min_compression * (n + m) * self.rank

    def layout(self, spec: PackSpec) -> Layout:
        """Which of the pack's tensors are compressed (pure: the same on every worker)."""
        matrices, dims, dense = [], [], []
        for position, shape in enumerate(spec.shapes):
            nm = matrix_shape(shape)
            if nm is not None and self.compresses(*nm):
                matrices.append(position)
                dims.append(nm)
            else:
                dense.append(position)
        return Layout(tuple(matrices), tuple(dims), tuple(dense))

    @property
    def factor_all_reduces(self) -> int:
        """Factor all-reduces per step on each wire: 2 (the P's, then the Q's), 1 with `alternate`."""
        return 1 if self.alternate else 2

    def factor_elements(self, layout: Layout) -> float:
        """Factor elements a step sends for a pack of `layout` (pure): (n + m) rank summed over
        its matrices; with `alternate` the mean of a P step (n rank) and a Q step (m rank)."""
        elements = sum((n + m) * self.rank for n, m in layout.dims)
        return elements / 2 if self.alternate else elements

    def create_states(self, packs, devices):
        """Per pack with compressed matrices its `LowRankState`, else None; with compressed
        matrices the set's `LowRankSetState` (its step count), else None.

        Raises:
          ValueError: the set has matrices and this rank compresses none of them (the message
            gives the ranks that would compress its largest, or says that none does).
        """
        self._check_useful([shape for spec in packs for shape in spec.shapes])
        states = []
        for p, spec in enumerate(packs):
            layout = self.layout(spec)
            if not layout.matrices:
                states.append(None)
                continue
            factors = [initial_factor(m, self.rank, self.seed, p, j)
                       for j, (_, m) in enumerate(layout.dims)]
            p_shapes = [(n, self.rank) for n, _ in layout.dims] if self.alternate else None
            states.append(LowRankState(spec.key.replace("/", "_"), factors,
                                       sum(n * m for n, m in layout.dims), devices, p_shapes))
        shared = None
        if any(s is not None for s in states):
            shared = LowRankSetState(packs[0].key.replace("/", "_"), len(devices),
                                     restored_without_steps=self.warmup_steps)
        return shared, states

    def _check_useful(self, shapes) -> None:
        dims = [nm for nm in map(matrix_shape, shapes) if nm is not None]
        if not dims or any(self.compresses(n, m) for n, m in dims):
            return
        n, m = max(dims, key=lambda nm: nm[0] * nm[1] / (nm[0] + nm[1]))
        best = int(n * m // (self.min_compression * (n + m)))
        accepted = (f"rank 1 to {best}" if best >= 1 else
                    f"no rank; min_compression must be at most {n * m / (n + m):g} for it")
        raise ValueError(f"rank {self.rank} compresses none of this model's matrices at "
                         f"min_compression {self.min_compression:g}: its best, {n}x{m}, takes "
                         f"{accepted}")

    def settings(self):
        """rank, min_compression, seed and warmup_steps, then with `alternate` a fifth,
        "low-rank alternate" = 1 (the handshake pads a two-collective worker's list with 0
        there, so the two forms never agree)."""
        own = [("low-rank rank", self.rank, lambda v: str(int(v))),
               ("low-rank min_compression", self.min_compression, lambda v: f"{v:g}"),
               ("low-rank seed", self.seed, lambda v: str(int(v))),
               ("low-rank warmup_steps", self.warmup_steps, lambda v: str(int(v)))]
        if self.alternate:
            own.append(("low-rank alternate", 1, lambda v: str(bool(v))))
        return own

    def state_settings(self):
        """`settings()` but warmup_steps (it only makes steps dense): checkpoints cross it."""
        return [s for s in self.settings() if s[0] != "low-rank warmup_steps"]

    def cost(self, elements, wire_format):
        """The set modelled as one square matrix of `elements` (the planner knows no shapes): a
        control vector on a scaled wire, then its P and its Q (with `alternate` one of them);
        dense when it would not shrink."""
        side = max(1, math.isqrt(int(elements)))
        if not self.compresses(side, side):
            return CostTerms((wire_format.wire_bytes * int(elements),))
        factors = (wire_format.wire_bytes * side * self.rank,) * self.factor_all_reduces
        return CostTerms(((8,) if wire_format.scaled else ()) + factors)

    def reduce(self, step: StepInput):
        if step.shared is None or not self.warmup_steps:
            return self._compressed(step)
        comm, steps = step.comm, step.shared.steps
        count = _count(step)

        def warm_up():
            outputs, sent = DenseReducer().reduce(step)
            finite = [_all_finite(tf.constant(True), [t for pack in outputs for t in pack[i]])
                      for i in range(len(comm.replicas))]
            _commit(comm, finite, [[(steps[r], count + 1)] for r in comm.replicas])
            return outputs, _as_int64(sent.sent_bytes, 0, 0)

        def compress():
            outputs, sent = self._compressed(step)
            return outputs, _as_int64(sent.sent_bytes, sent.figures["compressed_elements"],
                                      sent.figures["factor_elements"])

        outputs, (sent_bytes, compressed, factors) = tf.cond(count < self.warmup_steps, warm_up,
                                                             compress)
        return outputs, Sent(dense_bytes=4 * sum(pack.spec.num_elements for pack in step.packs),
                             sent_bytes=sent_bytes, figures={"compressed_elements": compressed,
                                                             "factor_elements": factors})

    def _compressed(self, step: StepInput):
        """A compressed step (the module docstring): (outputs, what it sent)."""
        comm = step.comm
        sums = dataclasses.replace(comm, mean=False)   # the factors' sums; MEAN applied to `out`
        layouts = [self.layout(pack.spec) for pack in step.packs]
        dense_packs = [dense_part(pack, layout) for pack, layout in zip(step.packs, layouts)]
        dense_packs = [(p, part) for p, part in enumerate(dense_packs) if part is not None]
        matrices = [Matrix(p, position, n, m, j, offset)
                    for p, layout in enumerate(layouts)
                    for j, (position, (n, m), offset) in enumerate(
                        zip(layout.matrices, layout.dims, layout.offsets))]
        wires = {}   # matrices by the wire their pack travels on, in step order
        for matrix in matrices:
            wires.setdefault(step.packs[matrix.pack].spec.wire, []).append(matrix)
        # Per replica, per matrix: (M_r, P_r, M_r's largest column norm); the alternating
        # form's P_r depends on its phase (None here).
        projected = comm.map(lambda r, *grads: [self._project(step.packs[x.pack], x, r,
                                                              grads[x.pack])
                                                for x in matrices], *[p.grads for p in step.packs])
        ms = [[m for m, _, _ in per_replica] for per_replica in projected]
        index = {x: i for i, x in enumerate(matrices)}
        groups = [(wire_format, group, [[m[index[x]] for x in group] for m in ms])
                  for wire_format, group in wires.items()]
        commits = [[] for _ in comm.replicas]
        sends_p = None
        if step.shared is not None and matrices:
            count = _count(step)
            for i, r in enumerate(comm.replicas):
                commits[i].append((step.shared.steps[r], count + 1))
            with tf.device("/cpu:0"):   # the alternating phase, from the first compressed step
                sends_p = tf.equal((count - self.warmup_steps) % 2, 0)
        # The two-collective form's P_r and column norms, before the control all-reduce.
        local_ps = [None if self.alternate else
                    [[projected[i][index[x]][1:] for x in group] for i in range(len(ms))]
                    for _, group, _ in groups]
        controls = fuse_controls(comm, [DenseReducer.bounds(part, comm) for _, part in dense_packs]
                                 + [self._bounds(group_ms, ps, sends_p, wire_format, comm)
                                    for (wire_format, _, group_ms), ps in zip(groups, local_ps)])
        outputs = [[[None] * len(pack.spec.shapes) for _ in comm.replicas] for pack in step.packs]
        sent = Sent(dense_bytes=4 * sum(x.n * x.m for x in matrices),
                    figures={"compressed_elements": sum(x.n * x.m for x in matrices),
                             # the alternating form's factor depends on the step's phase
                             "factor_elements": 0 if self.alternate else
                             sum(self.factor_elements(layout) for layout in layouts)})
        finite = [tf.constant(True) for _ in comm.replicas]
        for (p, part), bounds in zip(dense_packs, controls):
            reduced, part_sent = DenseReducer.reduce_pack(part.spec, part.grads, bounds, comm)
            sent += part_sent
            for i, tensors in enumerate(reduced):
                for position, value in zip(layouts[p].dense, tensors):
                    outputs[p][i][position] = value
                finite[i] = _all_finite(finite[i], tensors)
        for (wire_format, group, group_ms), ps, bounds in zip(groups, local_ps,
                                                             controls[len(dense_packs):]):
            if self.alternate:
                sent += alternate_factors(step, group, group_ms, bounds, wire_format, sums,
                                          self.rank, sends_p, outputs, finite, commits)
            else:
                sent += self._factors(step, group, group_ms, ps, bounds, wire_format, sums,
                                      outputs, finite, commits)
        _commit(comm, finite, commits)
        return outputs, sent

    def _project(self, pack: PackStep, x: Matrix, r: int, grads):
        """Replica r's (M: its gradient as float32 [n, m] plus its residual, P_r = M Q or None
        in the alternating form, M's largest column norm or None): `ops.lowrank_project`."""
        residual = tf.reshape(pack.state.residuals[r][x.offset:x.offset + x.n * x.m], [x.n, x.m])
        grad = tf.reshape(grads[x.position], [x.n, x.m])
        if self.alternate:
            return tf.cast(grad, tf.float32) + residual, None, None
        return ops.lowrank_project(grad, residual, pack.state.qs[x.j][r])

    def _bounds(self, ms, local_ps, sends_p, wire_format: wire.WireFormat,
                comm) -> List[tf.Tensor]:
        """Per served replica float32 [2 k] for the k matrices of a wire (`ms`: per replica
        their M's; `local_ps`: per replica their (P_r, M_r's largest column norm), None in the
        alternating form): the bounds of their P's, then of their Q's (module docstring); [0]
        on an unscaled wire. The alternating form computes the bound of the one factor its
        phase sends (`sends_p`) from M and 0 for the other."""
        if not wire_format.scaled:
            return no_control(comm)
        if self.alternate:
            def bounds(r, m_list):
                zeros = tf.zeros([len(m_list)])
                return tf.cond(sends_p,
                               lambda: tf.concat([largest_norm(m_list, axis=1), zeros], 0),
                               lambda: tf.concat([zeros, largest_norm(m_list, axis=0)], 0))
            return comm.map(bounds, ms)
        return comm.map(lambda r, projections: tf.concat(
            [ops.abs_max([p for p, _ in projections]),
             tf.stack([bound for _, bound in projections])], 0), local_ps)

    def _factors(self, step: StepInput, group: List[Matrix], ms, local_ps, bounds, wire_format,
                 sums, outputs, finite, commits) -> Sent:
        """The P and Q all-reduces of one wire's matrices (`local_ps`: per replica their
        (P_r, M_r's largest column norm));
        fills `outputs`, ANDs the factors' finiteness into `finite` and appends the state's new
        values to `commits` (per replica)."""
        comm, k, rank = step.comm, len(group), self.rank
        dtype = step.packs[group[0].pack].spec.wire_dtype
        states = [step.packs[x.pack].state for x in group]

        def send_p(r, p_list, bound):
            prescale, postscale = wire_scales(wire_format, sums, lambda: bound[:k])
            return ops.pack(p_list, dtype, prescale), postscale
        p_buffers, p_post = zip(*comm.map(
            send_p, [[p for p, _ in projections] for projections in local_ps], bounds))
        p_sums = comm.all_reduce_sum(list(p_buffers))

        def send_q(r, m_list, p_sum, post, bound):
            ps = [orthogonalise(p) for p in ops.unpack(p_sum, [[x.n, rank] for x in group],
                                                       [tf.float32] * k, post)]
            qs = [ops.lowrank_project_back(m, p) for m, p in zip(m_list, ps)]
            prescale, postscale = wire_scales(wire_format, sums, lambda: bound[k:])
            return ops.pack(qs, dtype, prescale), postscale, ps, qs
        q_buffers, q_post, p_hats, local_qs = zip(*comm.map(send_q, ms, p_sums, p_post, bounds))
        q_sums = comm.all_reduce_sum(list(q_buffers))

        def receive(r, i, q_sum, post, m_list, p_list, local_q_list):
            q_list = ops.unpack(q_sum, [[x.m, rank] for x in group], [tf.float32] * k, post)
            finite[i] = finite[i] & tf.reduce_all(tf.math.is_finite(p_sums[i])) & tf.reduce_all(
                tf.math.is_finite(q_sum))
            residuals = []
            for x, state, m, p, q, local_q in zip(group, states, m_list, p_list, q_list,
                                                  local_q_list):
                pack = step.packs[x.pack]
                shape, out_dtype = pack.spec.shapes[x.position], pack.spec.dtypes[x.position]
                out, residual = ops.lowrank_reconstruct(m, p, q * comm.postscale, p, local_q,
                                                        out_dtype)
                outputs[x.pack][i][x.position] = tf.reshape(out, shape)
                commits[i].append((state.qs[x.j][r], q))
                residuals.append(residual)
            commits[i] += residual_commits(group, states, r, residuals)
        comm.map(receive, range(len(comm.replicas)), q_sums, q_post, ms, p_hats, local_qs)
        factor_bytes = dtype.size * sum((x.n + x.m) * rank for x in group)
        return Sent(sent_bytes=factor_bytes + (8 * k if wire_format.scaled else 0))


def _all_finite(ok: tf.Tensor, tensors) -> tf.Tensor:
    """ok AND every element of `tensors` is finite."""
    for t in tensors:
        ok = ok & tf.reduce_all(tf.math.is_finite(t))
    return ok


def _count(step: StepInput) -> tf.Tensor:
    """The set's count of finite steps (`LowRankSetState.steps`, the first served replica's:
    every replica's is equal), int64 scalar on the host."""
    with tf.device("/cpu:0"):
        return step.shared.steps[step.comm.replicas[0]].read_value()


def _commit(comm, finite, commits) -> None:
    """Per served replica, assigns its (variable, value) pairs in one branch on its finite
    flag: a non-finite step writes none."""
    def assign(r, ok, pairs):
        def write():
            return tf.group([v.assign(value) for v, value in pairs])
        return tf.cond(ok, write, tf.no_op)
    comm.map(assign, finite, commits)


def _as_int64(*values) -> Tuple[tf.Tensor, ...]:
    """Python numbers or scalar tensors as int64 tensors (as both branches of a step return)."""
    return tuple(tf.cast(v, tf.int64) for v in values)
