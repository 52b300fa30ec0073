"""A float64 NumPy model of gf_tf.reducers.LowRank (power iteration with a warm-started Q,
modified Gram-Schmidt, per-replica error feedback, the FP16 wire's rounding of the factors).
Shared by test_lowrank and test_multistep, as csc_reference is by the CSC tests.
"""

import numpy as np

from gf_tf import wire
from gf_tf.reducers.lowrank import initial_factor


def gram_schmidt(p):
    """Modified Gram-Schmidt of the columns of p, float64 (a zero column stays zero)."""
    q = np.array(p, np.float64)
    for j in range(q.shape[1]):
        for k in range(j):
            q[:, j] -= (q[:, k] @ q[:, j]) * q[:, k]
        norm = np.linalg.norm(q[:, j])
        q[:, j] = q[:, j] / norm if norm else 0.0
    return q


def on_wire(values, bound, fp16):
    """Each replica's factor as it arrives in the sum: on the FP16 wire scaled by the power of
    two of the all-reduced bound, rounded to float16 and scaled back."""
    if not fp16:
        return values
    scale = wire.power_of_two_scale_np(bound)
    return [np.float16(v * scale).astype(np.float64) / scale for v in values]


class Model:
    """The method in float64, in pack order: per compressed matrix its Q (and P, alternating
    form) and per replica its residual; the other tensors summed. The first
    `reducer.warmup_steps` steps sum every tensor (the dense warm-up)."""

    def __init__(self, reducer, spec, replicas, fp16):
        self.reducer, self.fp16 = reducer, fp16
        self.layout = reducer.layout(spec)
        self.indices = spec.indices   # variable index of each pack position
        self.qs = [initial_factor(m, reducer.rank, reducer.seed, 0, j).astype(np.float64)
                   for j, (_, m) in enumerate(self.layout.dims)]
        self.ps = [np.zeros((n, reducer.rank)) for n, _ in self.layout.dims]
        self.count = 0   # the steps run (the set's count: warm-up, the alternating form's phase)
        self.residuals = [[np.zeros((n, m)) for n, m in self.layout.dims] for _ in range(replicas)]

    def load(self, arrays, count=0):
        """Q (and P) and the residuals from the reducer's state arrays (`LowRankState.to_arrays`),
        and the set's step count."""
        self.count = count
        for j, (n, m) in enumerate(self.layout.dims):
            self.qs[j] = arrays[f"q{j}_r0"].astype(np.float64)
            if self.reducer.alternate:
                self.ps[j] = arrays[f"p_factor{j}_r0"].astype(np.float64)
        for r, residuals in enumerate(self.residuals):
            flat = arrays[f"residual_r{r}"].astype(np.float64)
            for j, offset in enumerate(self.layout.offsets):
                n, m = self.layout.dims[j]
                residuals[j] = flat[offset:offset + n * m].reshape(n, m)

    def arrays(self):
        """The model's state under the reducer's array keys."""
        out = {f"q{j}_r{r}": q for j, q in enumerate(self.qs) for r in range(len(self.residuals))}
        if self.reducer.alternate:
            out.update({f"p_factor{j}_r{r}": p for j, p in enumerate(self.ps)
                        for r in range(len(self.residuals))})
        out.update({f"residual_r{r}": np.concatenate([res.ravel() for res in residuals])
                    for r, residuals in enumerate(self.residuals)})
        return out

    def step(self, grads):
        if self.count < self.reducer.warmup_steps:
            return self._dense(grads)
        out = {}
        for position in self.layout.dense:
            i = self.indices[position]
            out[i] = sum(g[i].astype(np.float64) for g in grads)
        for j, (position, (n, m)) in enumerate(zip(self.layout.matrices, self.layout.dims)):
            i = self.indices[position]
            ms = [g[i].astype(np.float64).reshape(n, m) + res[j] for g, res in zip(grads, self.residuals)]
            if self.reducer.alternate:
                out[i] = self._alternate(j, ms).reshape(grads[0][i].shape)
                continue
            q = self.qs[j]
            ps = [mm @ q for mm in ms]
            bound = sum(np.abs(p).max() for p in ps)
            p_hat = gram_schmidt(sum(on_wire(ps, bound, self.fp16)))
            local_qs = [mm.T @ p_hat for mm in ms]
            bound = sum(np.linalg.norm(mm, axis=0).max() for mm in ms)
            self.qs[j] = sum(on_wire(local_qs, bound, self.fp16))
            for res, mm, local_q in zip(self.residuals, ms, local_qs):
                res[j] = mm - p_hat @ local_q.T
            out[i] = (p_hat @ self.qs[j].T).reshape(grads[0][i].shape)
        self.count += 1
        return [out[i] for i in range(len(grads[0]))]

    def _dense(self, grads):
        """A warm-up step: every tensor summed as a dense FP16 pack sends it (scaled by the power
        of two of the SUM of its max |g|); the state unchanged but the count."""
        self.count += 1
        return [sum(on_wire([g[i].astype(np.float64) for g in grads],
                            sum(np.abs(g[i]).max() for g in grads), self.fp16))
                for i in range(len(grads[0]))]

    def _alternate(self, j, ms):
        """Matrix j's ACP-SGD step: on an even count P = SUM M_r Q^, else Q = SUM M_r^T P^ (the
        other factor orthogonalised); the reduced matrix; the residuals."""
        if (self.count - self.reducer.warmup_steps) % 2 == 0:
            q_hat = gram_schmidt(self.qs[j])
            local = [mm @ q_hat for mm in ms]
            bound = sum(np.linalg.norm(mm, axis=1).max() for mm in ms)
            self.ps[j] = sum(on_wire(local, bound, self.fp16))
            for res, mm, p in zip(self.residuals, ms, local):
                res[j] = mm - p @ q_hat.T
            return self.ps[j] @ q_hat.T
        p_hat = gram_schmidt(self.ps[j])
        local = [mm.T @ p_hat for mm in ms]
        bound = sum(np.linalg.norm(mm, axis=0).max() for mm in ms)
        self.qs[j] = sum(on_wire(local, bound, self.fp16))
        for res, mm, q in zip(self.residuals, ms, local):
            res[j] = mm - p_hat @ q.T
        return p_hat @ self.qs[j].T
