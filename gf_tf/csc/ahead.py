"""selection="ahead": chunks chosen one step ahead, so a sparse step is one collective per group.

Source: GradientFlow (arXiv 1902.06855), "coarse-grained sparse communication" and its
Algorithm 1: the important chunks of an iteration are chosen from norms all-reduced at the
iteration before, so each chunk can leave as soon as its gradients are written.

Per pack (n elements, C chunks of `chunk_size`), per served replica, a sparse step at k:

  acc, norms, u = accumulate(residual, g)   as in gf_tf.csc (norms: local chunk L1 of acc)
  idx    = the k largest `scores` (state, all-reduced at the previous step: the same on
           every replica of every worker), ties to the lower index, ascending
  s      = power_of_two_scale(MARGIN * bound), bound (state) from the previous step: after
           a sparse step the SUM over replicas of max(norms), after a dense step the largest
           all-reduced chunk norm max(SUM over replicas of norms), which is no larger; both
           bound |every partial sum| of that step's chunks; 1 on a wire that needs no scale
  buffer = [chunks idx of acc, zero-padded to k*chunk_size | next scores (C) | max(norms)],
           in float32, times s, cast to the wire dtype (rounded to nearest even)
  buffer = all-reduce(buffer)               ONE collective per wire dtype of the group
  out    = the chunks / s, scattered into the pack's tensors (x 1/N for MEAN)
  residual = acc with chunks idx set to 0;  u = u with chunks idx set to 0 (masking)
  scores, bound = the buffer's sums         (the next step's choice and scale)

The next step's score of a chunk (`ChunkSparsity.scoring`), summed over replicas:
  "error_feedback": the chunk L1 norm of residual + momentum * u after this step, the part
    of the next step's accumulator known now (for a chunk not sent, its L1 norm of
    acc + momentum * u, which `ops.accumulate(lookahead=True)` sums in its one pass);
  "paper": the chunk L1 norm of the residual, and for a chunk just sent the L1 norm of its
    all-reduced sum (GradientFlow's norms over the buffer after the all-reduce, where a
    sent chunk holds the sum and its norm, divided by N on each of N workers, adds up to
    the sum's).
A dense (warm-up) step runs as in gf_tf.csc (norms all-reduced first, so its FP16 scale
is exact) and scores every chunk by the L1 norm of its all-reduced sum, so the last warm-up
step chooses the first sparse step's chunks.

The FP16 guarantee. Per-pack selection scales each chunk from its all-reduced L1 norm,
which bounds every partial sum of the ring; here nothing of this step's gradients is
all-reduced before the chunks leave, so the scale comes from the previous step's bound with
MARGIN to spare (2**-14 of FP16's 65504 at the scale's target, 2**15 / MARGIN). A sum that
still overflows is inf on every worker alike, and that step's buffer is all-reduced again
in float32 from the same accumulator: exact, at twice the bytes and one more collective, on
that step only. A group with no bound yet (the first sparse step without a dense warm-up)
goes float32 at once. A float32 sum that is not finite is a non-finite gradient: the step
keeps the state as it was on every worker, and its sent chunks come out NaN, so a loss-scale
optimizer skips it as it would TensorFlow's own all-reduce of that gradient.
"""

from typing import List, Sequence

import tensorflow as tf

from gf_tf import ops, wire
from gf_tf.csc import buffers, selection
from gf_tf.csc.per_pack import PerPackSelection
from gf_tf.csc.state import CSCState
from gf_tf.reducers import Communicator, StepInput, fuse_controls

# The FP16 scale's headroom over the previous step's bound: the sum may grow 2**4 = 16x in
# one step (MARGIN times the 2x of power_of_two_scale's target) before a float32 retry.
MARGIN = 8.0


class AheadSelection(PerPackSelection):
    """selection="ahead": each pack sends its own top k of its C_p chunks, chosen at the
    previous step from all-reduced scores, so a sparse step needs no norm all-reduce before
    its chunk all-reduce: the next step's scores travel in the same buffer (`sparse_step`).
    Its dense (warm-up) steps run as per-pack steps and score every chunk for the next.
    Its figure "float32_retries" counts the wire groups whose FP16 sum is not finite, so
    that they go again in float32 (`CommStats`: "float32_retries_per_step")."""
    name = "ahead"
    scorings = ("error_feedback", "paper")
    carries_control = False
    figures = ("float32_retries",)

    def create_state(self, name, num_elements, num_chunks, devices, momentum, steps):
        """One pack's `CSCState`, with its scores (float32 [C]) and bound per replica."""
        return CSCState(name, num_elements, devices, momentum, steps, num_chunks)

    def controls(self, comm, timing, accumulated):
        """(timing, None): the norms are all-reduced on dense steps only, in their branch."""
        del comm, accumulated
        return timing, None

    def step(self, chunk_step, sparsity, step, counts, accumulated, norms, plan):
        """A sparse step (`sparse_step`, one collective per wire group, and its float32
        retries), or a dense one that all-reduces its norms first."""
        if plan.density < 1.0:
            outputs, residual_l1, retries = sparse_step(sparsity, step, counts,
                                                        accumulated, plan)
            return outputs, residual_l1, [], [], {"float32_retries": retries}
        norms = fuse_controls(step.comm, [a.norms for a in accumulated])
        return chunk_step(step, counts, accumulated, norms, plan)

    def dense_updates(self, state, replica, values, postscale, norms, comm, chunk_size):
        """A dense step chooses the next step's chunks: (scores, `dense_scores`) and (bound,
        the largest all-reduced chunk norm)."""
        return ((state.scores[replica], dense_scores(values, postscale, comm, chunk_size)),
                (state.bounds[replica], tf.reduce_max(norms)))

    def group_wire(self, counts, length, density, wire_bytes):
        """A sparse step's buffer carries its chunks, then the next scores (C) and bound (1)
        per pack, all on the wire: no separate norms."""
        if density >= 1.0:
            return super().group_wire(counts, length, density, wire_bytes)
        length += sum(count + 1 for count in counts)
        return length, length * wire_bytes

    def step_bytes(self, chunks, chunk_size, density, wire_bytes):
        """(selected chunks + the next step's scores and bound,): one collective."""
        selected = wire_bytes * chunk_size * selection.selected_chunk_count(chunks, density)
        return (selected + wire_bytes * (chunks + 1),)

    def wants_lookahead(self, sparsity):
        """With scoring "error_feedback": the next step's scores of the chunks not sent are
        their norms of acc + momentum * u, which the accumulate kernel sums in its pass."""
        return sparsity.scoring == "error_feedback"

    def config(self, sparsity):
        """{"scoring": sparsity.scoring}."""
        return {"scoring": sparsity.scoring}


class _Send:
    """One served replica's part of one pack: what it puts on the wire and commits."""

    def __init__(self, idx, prescale, known, wire_buffer, exact_buffer, new_residual, new_u):
        self.idx, self.prescale, self.known = idx, prescale, known
        self.wire_buffer, self.exact_buffer = wire_buffer, exact_buffer
        self.new_residual, self.new_u = new_residual, new_u


def sparse_step(sparsity, step: StepInput, counts: Sequence[int], accumulated, plan):
    """One sparse step of one group of packs at `plan` (a `selection.StepPlan`, density < 1).

    Args:
      sparsity: the ChunkSparsity (chunk_size, momentum, scoring).
      step: the group's StepInput (its packs, with `CSCState` holding scores and bounds).
      counts: per pack its chunk count C.
      accumulated: per pack its `reducer.Accumulated` (acc, local norms, new u per replica).

    Returns:
      (outputs: per pack, per served replica the reduced tensors (flat, pack by pack,
      replica by replica), residual_l1: float32 scalar of the first served replica,
      retries: int32 scalar, the wire groups whose FP16 sum went again in float32).
    """
    comm = step.comm
    sends = [_prepare(sparsity, pack, acc, count, k, comm)
             for pack, acc, count, k in zip(step.packs, accumulated, counts, plan.ks)]
    received = [[None] * len(comm.replicas) for _ in step.packs]
    finite, retries = tf.constant(True), tf.constant(0)
    for group in selection.wire_groups([pack.spec for pack in step.packs]):
        parts, group_finite, retried = _exchange([sends[j] for j in group], comm,
                                                 step.packs[group[0]].spec.wire)
        finite = tf.logical_and(finite, group_finite)
        retries += tf.cast(retried, tf.int32)
        for j, part in zip(group, parts):
            received[j] = part
    outputs, residual_l1 = [], 0.0
    for pack, send, parts, count, k, acc in zip(step.packs, sends, received, counts, plan.ks,
                                                accumulated):
        outputs.extend(_finish(sparsity, pack, send, parts, count, k, finite, comm))
        residual_l1 += buffers.record_residual_l1(pack.state, acc.norms[0], send[0].idx,
                                                   finite, comm)
    return outputs, residual_l1, retries


def _prepare(sparsity, pack, accumulated, count, k, comm: Communicator) -> List[_Send]:
    """Per served replica: the pack's chunks, next scores and bound contribution."""
    spec, state, cs = pack.spec, pack.state, sparsity.chunk_size
    length = spec.num_elements if k is None else k * cs
    scaled = spec.wire.scaled

    def prepare(r, acc, norms, new_u, lookahead):
        if k is None:
            idx = tf.range(count, dtype=tf.int32)
        else:
            idx = selection.select_chunks(state.scores[r].read_value(), k)
        bound = state.bounds[r].read_value()
        known = tf.logical_and(tf.math.is_finite(bound), bound > 0.0)
        prescale = wire.power_of_two_scale(MARGIN * bound) if scaled else tf.constant(1.0)
        masked = k is not None and new_u is not None
        # Gathered in float32 (k chunks): the retry reuses them, so nothing else holds acc,
        # and the kernel writes the residual into acc's buffer instead of copying n floats.
        exact, new_residual, masked_u = ops.gather_chunks(
            acc, idx, cs, tf.float32, 1.0, new_u if masked else None)
        exact = buffers.pad_to(exact, length)
        next_u = masked_u if masked else new_u
        if masked and lookahead is not None:   # a sent chunk's residual and u are 0
            scores = buffers.without_chunks(lookahead, idx)
        elif sparsity.scoring == "error_feedback" and next_u is not None:
            scores = buffers.chunk_l1(new_residual + sparsity.momentum * next_u, cs)
        else:   # the residual's chunk norms: acc's, with the sent chunks at 0
            scores = buffers.without_chunks(norms, idx)
        exact = tf.concat([exact, scores, tf.reshape(tf.reduce_max(norms), [1])], 0)
        wire_buffer = tf.cast(exact * prescale, spec.wire_dtype)
        return _Send(idx, prescale, known, wire_buffer, exact, new_residual, next_u)

    return comm.map(prepare, accumulated.accs, accumulated.norms, accumulated.new_us,
                    accumulated.lookaheads)


def _exchange(members: List[List[_Send]], comm: Communicator, wire_format: wire.WireFormat):
    """All-reduce one wire group's buffers: (per member pack, per served replica its float32
    buffer of SUMs, unscaled; bool scalar: every sum is finite, the same on every worker;
    bool scalar: the FP16 sum is not finite and went again in float32)."""
    sizes = [int(send[0].wire_buffer.shape[0]) for send in members]
    replicas = range(len(comm.replicas))

    def reduce(buffers, unscale):
        summed = comm.all_reduce_sum(buffers)
        parts, finite = [[None] * len(comm.replicas) for _ in members], tf.constant(True)
        for i in replicas:
            with tf.device(summed[i].device):
                finite = tf.logical_and(finite, tf.reduce_all(tf.math.is_finite(summed[i])))
                for j, part in enumerate(tf.split(summed[i], sizes)):
                    parts[j][i] = tf.cast(part, tf.float32) * unscale(j, i)
        return parts, finite

    def on_wire():
        return reduce([tf.concat([send[i].wire_buffer for send in members], 0) for i in replicas],
                      lambda j, i: 1.0 / members[j][i].prescale)

    if not wire_format.scaled:   # float32 or bfloat16: float32's range
        return (*on_wire(), tf.constant(False))

    def exact():
        return reduce([tf.concat([send[i].exact_buffer for send in members], 0)
                       for i in replicas], lambda j, i: 1.0)

    def nothing():
        return ([[tf.zeros([size], tf.float32) for _ in replicas] for size in sizes],
                tf.constant(False))

    known = tf.reduce_all(tf.stack([send[i].known for send in members for i in replicas]))
    first = tf.cond(known, on_wire, nothing)
    return (*tf.cond(first[1], lambda: first, exact),
            tf.logical_and(known, tf.logical_not(first[1])))


def _finish(sparsity, pack, sends: List[_Send], parts, count, k, finite, comm) -> List[tf.Tensor]:
    """The pack's reduced tensors per served replica (flat); commits its state if `finite`."""
    spec, state, cs = pack.spec, pack.state, sparsity.chunk_size
    length = spec.num_elements if k is None else k * cs
    poison = tf.where(finite, 1.0, float("nan"))

    def finish(r, send: _Send, part):
        chunks, control = part[:length], part[length:]
        if k is None:
            m = spec.num_elements
        else:
            m = buffers.selected_length(spec.num_elements, cs, send.idx)
        out = ops.scatter_chunks(chunks[:m], send.idx, cs, spec.shapes, spec.dtypes,
                                 comm.postscale * poison)
        scores = control[:count]
        if sparsity.scoring == "paper":
            scores = tf.tensor_scatter_nd_update(scores, tf.reshape(send.idx, [-1, 1]),
                                                 buffers.chunk_l1(chunks, cs))
        updates = [(state.residuals[r], send.new_residual), (state.scores[r], scores),
                   (state.bounds[r], control[count])]
        if state.velocities:
            updates.append((state.velocities[r], send.new_u))
        buffers.assign_if(finite, updates)
        return out

    return [t for tensors in comm.map(finish, sends, parts) for t in tensors]


def dense_scores(values: tf.Tensor, postscale, comm: Communicator, chunk_size: int) -> tf.Tensor:
    """A dense step's scores for the next step: the chunk L1 norms of its all-reduced SUM.

    values: the received buffer (wire dtype, n elements, prescaled); postscale: what
    turns it into the step's output (shape [] or [C]: 1/prescale, x 1/N for MEAN)."""
    return buffers.chunk_l1(values, chunk_size) * (postscale / comm.postscale)
