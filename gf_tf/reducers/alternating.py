"""The low-rank reducer's one-collective form (ACP-SGD): a step sends the P's or the Q's, in turn.

With Q^ = orthogonalise(Q) and P^ = orthogonalise(P), Q and P the last all-reduced factors
(float32 [m, rank] and [n, rank], equal on every replica; the first Q `initial_factor`), a step
with an even count (`LowRankSetState.steps`) sends the P's and the next one the Q's:

    even:  P_r = M_r Q^;    P = SUM_r P_r   (one all-reduce);  out = P Q^T;   residual_r = M_r - P_r Q^T
    odd:   Q_r = M_r^T P^;  Q = SUM_r Q_r   (one all-reduce);  out = P^ Q^T;  residual_r = M_r - P^ Q_r^T

(out times 1/N for MEAN). Each step is half a power-iteration step, warm-started from the other
factor, and the residuals of all replicas add up to SUM_r M_r - out, as in the two-collective
form (`gf_tf.reducers.lowrank`). The phase is one `tf.cond` over the factors (the count moves
together on every worker, so every worker issues the same one collective); out and the residual
are then one pass over M_r (`ops.lowrank_reconstruct`), and the residual is written only on a
finite step. On a scaled wire the bound of the phase's factor uses Q^'s (P^'s) unit columns:
|P_r| <= max row norm of M_r, |Q_r| <= max column norm of M_r.

Source: Zhang, Zhang, Shi, Chu and Li, "Evaluation and Optimization of Gradient Compression for
Distributed Deep Learning" (ICDCS 2023), ACP-SGD (Alternate Compressed PowerSGD), Algorithm 2.
"""

from typing import List

import tensorflow as tf

from gf_tf import ops, wire
from gf_tf.reducers.base import Sent, StepInput, wire_scales
from gf_tf.reducers.factors import Matrix, orthogonalise, residual_commits


def alternate_factors(step: StepInput, group: List[Matrix], ms, bounds, wire_format: wire.WireFormat,
                      sums, rank: int, sends_p: tf.Tensor, outputs, finite, commits) -> Sent:
    """The one factor all-reduce of one wire's matrices (module docstring).

    Args:
      group: the wire's compressed matrices; ms: per served replica their float32 [n, m]
        gradients plus residuals; bounds: per served replica float32 [2 k], the all-reduced
        bounds of the P's, then of the Q's (unused on an unscaled wire); sums: the communicator
        without MEAN; sends_p: bool scalar, this step sends the P's.
      outputs, finite, commits: filled as `LowRank.reduce`'s (per pack, per replica the reduced
        tensors; per replica the AND of finiteness; per replica (variable, new value) pairs).

    Returns:
      What the step sent (a scalar tensor: the factor's bytes depend on the phase).
    """
    comm, k = step.comm, len(group)
    states = [step.packs[x.pack].state for x in group]
    dtype = step.packs[group[0].pack].spec.wire_dtype

    def branch(p_step: bool):
        def run():
            def send(r, m_list, bound):
                held = [(s.qs if p_step else s.ps)[x.j][r].read_value()
                        for s, x in zip(states, group)]
                fixed = [orthogonalise(f) for f in held]
                if p_step:
                    local = [m @ q for m, q in zip(m_list, fixed)]
                else:
                    local = [tf.matmul(m, p, transpose_a=True) for m, p in zip(m_list, fixed)]
                prescale, postscale = wire_scales(wire_format, sums,
                                                  lambda: bound[:k] if p_step else bound[k:])
                return ops.pack(local, dtype, prescale), postscale, fixed, local
            buffers, posts, fixed, local = zip(*comm.map(send, ms, bounds))
            summed = comm.all_reduce_sum(list(buffers))

            def receive(r, total, post, fixed_list, local_list):
                got = ops.unpack(total, [[x.n if p_step else x.m, rank] for x in group],
                                 [tf.float32] * k, post)
                kept = [(s.qs if p_step else s.ps)[x.j][r].read_value()
                        for s, x in zip(states, group)]
                # Per matrix the factors of out (MEAN's 1/N on the sum) and of M_r - residual_r.
                if p_step:
                    factors = [(g * comm.postscale, f, own, f)
                               for g, f, own in zip(got, fixed_list, local_list)]
                    new = (got, kept)
                else:
                    factors = [(f, g * comm.postscale, f, own)
                               for g, f, own in zip(got, fixed_list, local_list)]
                    new = (kept, got)
                return factors, new, tf.reduce_all(tf.math.is_finite(total))
            return comm.map(receive, summed, posts, fixed, local)
        return run

    per_replica = tf.cond(sends_p, branch(True), branch(False))
    for i, (r, m_list, (factors, (ps, qs), ok)) in enumerate(zip(comm.replicas, ms, per_replica)):
        finite[i] = finite[i] & ok
        residuals = []
        with tf.device(comm.devices[i]):
            for x, state, m, p, q, (a, b, a_own, b_own) in zip(group, states, m_list, ps, qs,
                                                                factors):
                pack = step.packs[x.pack]
                shape, out_dtype = pack.spec.shapes[x.position], pack.spec.dtypes[x.position]
                out, residual = ops.lowrank_reconstruct(m, a, b, a_own, b_own, out_dtype)
                outputs[x.pack][i][x.position] = tf.reshape(out, shape)
                commits[i] += [(state.ps[x.j][r], p), (state.qs[x.j][r], q)]
                residuals.append(residual)
        commits[i] += residual_commits(group, states, r, residuals)
    with tf.device("/cpu:0"):
        elements = tf.where(sends_p, sum(x.n for x in group), sum(x.m for x in group)) * rank
        sent_bytes = tf.cast(elements, tf.int64) * dtype.size + (4 * 2 * k if wire_format.scaled
                                                                 else 0)
    return Sent(sent_bytes=sent_bytes, figures={"factor_elements": tf.cast(elements, tf.int64)})
