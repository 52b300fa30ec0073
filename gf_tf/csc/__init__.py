"""Coarse-grained sparse communication (CSC): consistent top-k chunk all-reduce.

Source: GradientFlow (arXiv 1902.06855), "coarse-grained sparse
communication"; momentum correction and warm-up as in Deep Gradient
Compression (Lin et al., arXiv 1712.01887, sections 3.2 and 3.4).

Per pack of n float elements cut into C = ceil(n / chunk_size) chunks, per
local replica, one step:

  u   = momentum * u + g                   (only with momentum > 0)
  acc = residual + (u or g)                float32 [n]
  norms = L1 norm of each chunk of acc     float32 [C], all-reduced (SUM) in
                                           float32, so every replica on every
                                           worker sees the same vector
  idx = the k largest norms, ties to the lower chunk index, sorted ascending
  sel = chunks idx of acc, each prescaled on a float16 wire by a power of
        two chosen from its all-reduced L1 norm (which bounds every partial
        sum of the ring; see gf_tf.wire), cast to the wire dtype,
        zero-padded to k*chunk_size (a static shape)
  sel = all-reduce(sel)                    SUM over all N replicas
  out = sel postscaled (the inverse power of two) and scattered back into
        the pack's tensors, 0 elsewhere
  residual = acc with chunks idx set to 0  (assignment: error feedback)
  u   = u with chunks idx set to 0         (momentum factor masking)

A step whose all-reduced norms are not finite leaves residual and u as they
were (its output carries the inf/NaN so a loss-scale optimizer skips it).
Dense (warm-up) steps send every chunk the same way, without masking u.

The norms of all packs travel in the step's one control all-reduce
(`gf_tf.reducers.fuse_controls`), and the selected chunks of all packs in one more: two
collectives per step, whatever the number of packs (one more per extra wire
dtype, e.g. bfloat16 gradients beside float32 ones).
With ChunkSparsity(density="auto") the step's control all-reduce also
carries 3 timing figures per replica, from whose sums every replica picks the
same density (`choose_rung`); see ChunkSparsity.
With ChunkSparsity(selection="global") the k largest norms are taken over the
chunks of all packs of one wire dtype at once (K = ceil(density * their total
chunks), a static wire length K*chunk_size); each pack then sends its share
of those K chunks, a number that changes from step to step.
With ChunkSparsity(selection="ahead") each pack's k chunks are chosen at the
previous step from all-reduced scores that travel with that step's chunks, so
a sparse step is one collective (`gf_tf.csc.ahead`).
State (`CSCSetState` per variable set, `CSCState` per pack) is owned by
GradientFlowAllReduce's state for that variable set, never by the ChunkSparsity object.

Modules: `sparsity` (ChunkSparsity, defaults, schedule), `policies` (the registry of
selection policies by name, and the density rules), `selection` (chunk counts, top-k, the
`SelectionPolicy` interface, the plan of a step), one module per selection policy
(`per_pack`, `global_top_k`, `ahead`: with its one-collective sparse step), the density
rules (`density`: fixed; `auto`: density="auto"'s rule, clock and timing state), `state`,
`reducer` (the step, which asks the policy and the rule and tests neither), `buffers`
(tensor helpers).
"""

from gf_tf.csc.auto import AUTO, AUTO_LADDER, TIMING_FIGURES, AutoDensity, choose_rung
from gf_tf.csc.density import MIN_CHUNKS, DensityRule, FixedDensity
from gf_tf.csc.policies import POLICIES, AheadSelection, GlobalSelection, PerPackSelection
from gf_tf.csc.reducer import CSCReducer
from gf_tf.csc.selection import SelectionPolicy, StepPlan, select_chunks, selected_chunk_count
from gf_tf.csc.sparsity import (DEFAULT_AUTO_BUDGET, DEFAULT_CHUNK_SIZE, DEFAULT_DENSITY,
                                DEFAULT_MIN_DENSITY, SCORINGS, SELECTIONS, WARMUP_MODES,
                                ChunkSparsity)
from gf_tf.csc.state import CSCSetState, CSCState

__all__ = ["AUTO", "AUTO_LADDER", "AheadSelection", "AutoDensity", "CSCReducer", "CSCSetState",
           "CSCState", "ChunkSparsity", "DEFAULT_AUTO_BUDGET", "DEFAULT_CHUNK_SIZE",
           "DEFAULT_DENSITY", "DEFAULT_MIN_DENSITY", "DensityRule", "FixedDensity", "GlobalSelection",
           "MIN_CHUNKS", "POLICIES",
           "PerPackSelection", "SCORINGS", "SELECTIONS", "SelectionPolicy", "StepPlan",
           "TIMING_FIGURES", "WARMUP_MODES", "choose_rung", "select_chunks",
           "selected_chunk_count"]
