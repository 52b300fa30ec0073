"""The pieces the low-rank reducer's two forms share (`gf_tf.reducers.lowrank`): matrix shapes,
the first factor, the orthogonalisation, which tensors of a pack are compressed, and the state.

Source: Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019); Zhang et al., "Evaluation and Optimization of Gradient
Compression for Distributed Deep Learning" (ICDCS 2023: ACP-SGD, the alternating form).
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from gf_tf import tf_internal
from gf_tf.reducers.base import PackStep, VariablesState


def matrix_shape(shape) -> Optional[Tuple[int, int]]:
    """(n, m) = (product of all dimensions but the last, the last) of a gradient of 2 or more
    dimensions (a conv kernel [h, w, in, out] -> [h w in, out]); None for fewer dimensions."""
    dims = [int(d) for d in tf.TensorShape(shape).as_list()]
    if len(dims) < 2:
        return None
    return int(np.prod(dims[:-1])), dims[-1]


def initial_factor(m: int, rank: int, seed: int, pack: int, matrix: int) -> np.ndarray:
    """The first Q (float32 [m, rank], standard normal) of matrix `matrix` of pack `pack`: from
    NumPy's PCG64 seeded with (seed, pack, matrix), so equal on every worker."""
    rng = np.random.default_rng([seed, pack, matrix])
    return rng.standard_normal((m, rank)).astype(np.float32)


def orthogonalise(p: tf.Tensor) -> tf.Tensor:
    """Modified Gram-Schmidt on the columns of float32 [n, r]: orthonormal columns (a zero column
    stays zero), in the columns' order. Deterministic: the same bits on every replica."""
    columns = []
    for j in range(int(p.shape[1])):
        column = p[:, j]
        for done in columns:
            column = column - tf.reduce_sum(done * column) * done
        columns.append(tf.math.divide_no_nan(column, tf.norm(column)))
    return tf.stack(columns, axis=1)


def largest_norm(ms: Sequence[tf.Tensor], axis: int) -> tf.Tensor:
    """float32 [len(ms)]: the largest row (axis=1) or column (axis=0) norm of each matrix. The
    column sums of squares are a product with a row of ones: TensorFlow's CPU Sum over the
    outer axis of a row-major matrix takes about three times as long as the matrix product."""
    def squares(m):
        if axis == 0:
            return tf.matmul(tf.ones([1, int(m.shape[0])]), tf.square(m))
        return tf.reduce_sum(tf.square(m), axis=1)
    return tf.stack([tf.sqrt(tf.reduce_max(squares(m))) for m in ms])


def residual_commits(group, states, r: int, residuals) -> List[tuple]:
    """Per pack of the matrices `group` (`states`: each matrix's pack state), its replica-r
    residual variable and its new value: the matrices' `residuals` (float32 [n, m], from
    `ops.lowrank_reconstruct`), flattened and concatenated in pack order."""
    commits = []
    for state in dict.fromkeys(states):
        own = [residual for s, residual in zip(states, residuals) if s is state]
        commits.append((state.residuals[r], tf.concat([tf.reshape(x, [-1]) for x in own], 0)))
    return commits


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which tensors of a pack are compressed.

    matrices: positions (in the pack) of the compressed tensors; dims: their (n, m);
    dense: positions of the others (they travel as a dense pack).
    """
    matrices: Tuple[int, ...]
    dims: Tuple[Tuple[int, int], ...]
    dense: Tuple[int, ...]

    @property
    def offsets(self) -> List[int]:
        """Where each matrix starts in the pack's residual vector (float32 [sum n m])."""
        return [int(o) for o in np.cumsum([0] + [n * m for n, m in self.dims])[:-1]]


class LowRankState(VariablesState):
    """Low-rank state of one pack on this worker (its compressed matrices only).

    qs: per matrix, per local replica float32 [m, rank] on the replica's device: the last
      all-reduced Q (equal on every replica), the first one `initial_factor`.
    ps: alternating form only (else None): per matrix, per local replica float32 [n, rank]: the
      last all-reduced P (equal on every replica), zeros before the first step (which sends P).
    residuals: per local replica float32 [sum of n m over the matrices], the matrices' residuals
      flattened in pack order.
    """

    def __init__(self, name: str, factors: Sequence[np.ndarray], residual_size: int,
                 devices: Sequence[str], p_shapes: Optional[Sequence[Tuple[int, int]]] = None):
        super().__init__(name=None)
        self.qs = [[tf_internal.local_variable(q, d, f"gf_lowrank_q{j}_{name}_r{r}")
                    for r, d in enumerate(devices)] for j, q in enumerate(factors)]
        self.ps = None if p_shapes is None else [
            [tf_internal.local_variable(tf.zeros(shape), d, f"gf_lowrank_p{j}_{name}_r{r}")
             for r, d in enumerate(devices)] for j, shape in enumerate(p_shapes)]
        self.residuals = [tf_internal.local_variable(tf.zeros([residual_size]), d,
                                                     f"gf_lowrank_residual_{name}_r{r}")
                          for r, d in enumerate(devices)]

    def named_variables(self) -> Dict[str, tf.Variable]:
        """Every variable by its array key: "q{j}_r{r}", then "p_factor{j}_r{r}" (alternating
        form), then "residual_r{r}"."""
        named = {f"q{j}_r{r}": v for j, per_replica in enumerate(self.qs)
                 for r, v in enumerate(per_replica)}
        named.update({f"p_factor{j}_r{r}": v for j, per_replica in enumerate(self.ps or [])
                      for r, v in enumerate(per_replica)})
        named.update({f"residual_r{r}": v for r, v in enumerate(self.residuals)})
        return named


class LowRankSetState(VariablesState):
    """The state of a variable set shared by its packs.

    steps: per local replica, int64 scalar on the host: the steps that all-reduced finite
      values, dense warm-up steps included. Below `LowRank.warmup_steps` the next step is
      dense; after it, in the alternating form, an even count of compressed steps sends the P's
      next, an odd one the Q's. It moves on every worker together (the finiteness it waits for
      is that of all-reduced values).
    restored_without_steps: the count a checkpoint without counters restores to (one written
      by a LowRank with neither a warm-up nor the alternating form, which compressed from its
      first step): the warm-up's length, so the restored run goes on compressing.
    """

    def __init__(self, name: str, num_replicas: int, restored_without_steps: int = 0):
        super().__init__(name=None)
        self.steps = [tf_internal.local_variable(tf.constant(0, tf.int64), "/cpu:0",
                                                 f"gf_lowrank_step_{name}_r{r}")
                      for r in range(num_replicas)]
        self.restored_without_steps = restored_without_steps

    def named_variables(self) -> Dict[str, tf.Variable]:
        """The counters by array key: "step_r{r}"."""
        return {f"step_r{r}": v for r, v in enumerate(self.steps)}

    @property
    def optional_keys(self):
        """The counters: a checkpoint may lack them (`restored_without_steps`)."""
        return tuple(self.named_variables())

    def assign_arrays(self, arrays) -> None:
        """Restores the counters; a missing one becomes `restored_without_steps`."""
        for key, v in self.named_variables().items():
            v.assign(arrays.get(key, self.restored_without_steps))


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One compressed matrix of a step: its pack (index in the step), its position there, its
    (n, m), its index j in the pack's state and its offset in the pack's residual."""
    pack: int
    position: int
    n: int
    m: int
    j: int
    offset: int


def dense_part(pack: PackStep, layout: Layout) -> Optional[PackStep]:
    """The pack's uncompressed tensors as a pack of their own (no state), or None."""
    if not layout.dense:
        return None
    spec = pack.spec
    shapes = tuple(spec.shapes[i] for i in layout.dense)
    part = dataclasses.replace(spec, key=f"{spec.key}_dense",
                               indices=tuple(spec.indices[i] for i in layout.dense),
                               shapes=shapes, dtypes=tuple(spec.dtypes[i] for i in layout.dense),
                               num_elements=sum(int(s.num_elements()) for s in shapes))
    return PackStep(part, [[g[i] for i in layout.dense] for g in pack.grads], None)
