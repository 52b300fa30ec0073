"""Backprop in the order the overlap groups leave: each group's gradients before later groups' work.

Overlap groups (gf_tf.reducers) leave in pack order: group 0 holds the last layers' gradients,
which backprop produces first. TensorFlow's executor, though, runs ready ops in no set order:
traced on ResNet-20 (README "Overlap"), it ran the last layer's BiasAddGrad and a late
Conv2DBackpropFilter at the end of backprop, so group 0, and every group behind it on the
ordering token, waited for the whole backward pass, and nothing overlapped.

`prioritize` adds control edges to the traced step so that the work only later groups need
waits for the previous group's gradients: the ops of group g's exclusive part (ancestors of its
gradients that are not ancestors of an earlier group's) that have no input in that part (its
frontier; sources such as placeholders and constants are left alone, their consumers wait)
get a control input from each gradient op of group g - 1. Every other exclusive op
depends on a frontier op, so group g - 1's gradients are computed before anything only group g
needs starts. The forward pass and everything an earlier group needs are never delayed (they are
ancestors of group 0's gradients). No cycle: a frontier op of group g is, by construction, no
ancestor of an earlier group's gradients, and every added edge goes from a group's gradient to a
later group's exclusive part. Values are unchanged; only the executor's order is. The same
priority ByteScheduler and TicTac give (Peng et al., SOSP 2019; Hashemi et al., SysML 2019),
here at the granularity of a group.

Graph mode only (a tf.function's FuncGraph); eagerly there is no graph to order, and gradients
from another graph (captured from outside the function) are left alone.
"""

from typing import List, Sequence, Set

import tensorflow as tf

from gf_tf import tf_internal


def prioritize(groups: Sequence[Sequence]) -> int:
    """Orders backprop so group g's gradients come before the ops only groups > g need.

    Args:
      groups: per group, in the order they all-reduce, its gradient values (tf.Tensor or
        tf.IndexedSlices, any dtype, of every served replica). Empty groups are skipped.

    Returns:
      the number of control edges added (0 eagerly, for one group, or when the gradients are
      not ops of the current graph).
    """
    if tf.executing_eagerly():
        return 0
    graph = tf.compat.v1.get_default_graph()
    op_groups = [[op for op in _ops_of(values) if op.graph is graph] for values in groups]
    op_groups = [ops for ops in op_groups if ops]
    seen: Set[tf.Operation] = set()
    added, previous = 0, None
    for ops in op_groups:
        exclusive = _ancestors(ops, seen)
        # Sources (placeholders, constants, variable handles) compute nothing: their consumers wait.
        work = {op for op in exclusive if _producers(op)}
        if previous:
            for op in work:
                if not _producers(op) & work and op not in previous:
                    for control in previous:
                        tf_internal.add_control_input(op, control)
                        added += 1
        seen |= exclusive
        previous = ops
    return added


def _ops_of(values) -> List[tf.Operation]:
    """The ops producing `values` (an IndexedSlices' values, indices and dense shape)."""
    ops = []
    for value in values:
        parts = ([value.values, value.indices, value.dense_shape]
                 if isinstance(value, tf.IndexedSlices) else [value])
        ops += [t.op for t in parts if t is not None and hasattr(t, "op")]
    return list(dict.fromkeys(ops))


def _producers(op: tf.Operation) -> Set[tf.Operation]:
    return {t.op for t in op.inputs} | set(op.control_inputs)


def _ancestors(ops: Sequence[tf.Operation], stop: Set[tf.Operation]) -> Set[tf.Operation]:
    """`ops` and every op with a data or control path to one of them, outside `stop`."""
    found, stack = set(), [op for op in ops if op not in stop]
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack += [p for p in _producers(op) if p not in stop and p not in found]
    return found
