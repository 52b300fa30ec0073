"""NumPy float64 reference models of CSC (gf_tf.ChunkSparsity), without wire rounding.

NumpyCSC is the algorithm of one pack; NumpyGlobalCSC is selection="global" (one top K over
the chunks of all packs). pack_order, flatten and chunks_zero lay a single pack's tensors out
the way the reference sees them. Shared by the CSC tests (test_sparsity, test_auto_density,
test_collectives, test_gradients_only, test_multistep, test_overlap).
"""

import math

import numpy as np

from gf_tf.csc import selected_chunk_count


class NumpyCSC:
    """The algorithm of gf_tf/csc in float64, for one pack (no wire rounding)."""

    def __init__(self, n, num_replicas, chunk_size, momentum=0.0):
        self.n, self.cs, self.m = n, chunk_size, momentum
        self.c = -(-n // chunk_size)
        self.residual = np.zeros([num_replicas, n])
        self.velocity = np.zeros([num_replicas, n])

    def chunk_norms(self, x):
        return np.array([np.abs(x[i * self.cs:(i + 1) * self.cs]).sum() for i in range(self.c)])

    def step(self, g, density):
        """g: [replicas, n] -> (output [n], selected chunk indices or None for dense)."""
        g = np.asarray(g, np.float64)
        k = max(1, math.ceil(density * self.c))
        u = self.m * self.velocity + g if self.m else g
        if k >= self.c:  # dense step: every chunk of residual + u leaves, the residual empties
            out = (self.residual + u).sum(0)
            if np.all(np.isfinite(out)):
                self.velocity = u
                self.residual = np.zeros_like(self.residual)
            return out, None
        acc = self.residual + u
        norms = sum(self.chunk_norms(a) for a in acc)
        finite = np.all(np.isfinite(norms))
        idx = self.choose(np.where(np.isnan(norms), np.inf, norms), k)
        mask = np.zeros(self.n, bool)
        for i in idx:
            mask[i * self.cs:(i + 1) * self.cs] = True
        out = np.where(mask, acc.sum(0), 0.0)
        if finite:
            self.residual = np.where(mask, 0.0, acc)
            self.velocity = np.where(mask, 0.0, u) if self.m else self.velocity
        return out, idx


    def choose(self, norms, k):
        """The chunks a sparse step sends (selection="per_pack"): the k largest of the summed
        `norms` (NaN already +inf), ties to the lower index, ascending."""
        order = np.lexsort((np.arange(self.c), -norms))  # largest first, ties: lower index
        return np.sort(order[:k])


class NumpyGlobalCSC:
    """selection="global" in float64: one top K over the chunk norms of all packs,
    concatenated in pack order; each pack keeps its own residual, velocity and finite check."""

    def __init__(self, sizes, num_replicas, chunk_size, momentum=0.0):
        self.packs = [NumpyCSC(n, num_replicas, chunk_size, momentum) for n in sizes]
        self.c = sum(p.c for p in self.packs)

    def step(self, gs, density):
        """gs[p]: [replicas, n_p] -> (per pack output [n_p], per pack its chunks or None: dense)."""
        k = selected_chunk_count(self.c, density)
        if k >= self.c:
            return [p.step(g, 1.0)[0] for p, g in zip(self.packs, gs)], None
        us = [p.m * p.velocity + g if p.m else np.asarray(g, np.float64)
              for p, g in zip(self.packs, gs)]
        accs = [p.residual + u for p, u in zip(self.packs, us)]
        norms = [sum(p.chunk_norms(a) for a in acc) for p, acc in zip(self.packs, accs)]
        key = np.concatenate(norms)
        key = np.where(np.isnan(key), np.inf, key)
        idx = np.sort(np.lexsort((np.arange(self.c), -key))[:k])  # largest; ties: lower index
        outs, shares, offset = [], [], 0
        for p, u, acc, norm in zip(self.packs, us, accs, norms):
            share = idx[(idx >= offset) & (idx < offset + p.c)] - offset
            offset += p.c
            mask = np.repeat(np.isin(np.arange(p.c), share), p.cs)[:p.n]
            outs.append(np.where(mask, acc.sum(0), 0.0))
            shares.append(share)
            if np.all(np.isfinite(norm)):
                p.residual = np.where(mask, 0.0, acc)
                p.velocity = np.where(mask, 0.0, u) if p.m else p.velocity
        return outs, shares


def pack_order(shapes):
    """Element order of the single pack: tensors in backprop (reverse) order."""
    return list(reversed(range(len(shapes))))


def flatten(arrays, order):
    return np.concatenate([np.ravel(arrays[i]) for i in order]).astype(np.float64)


def chunks_zero(x, cs):
    c = -(-len(x) // cs)
    return np.array([not np.any(x[i * cs:(i + 1) * cs]) for i in range(c)])


class NumpyAheadCSC:
    """selection="ahead" (gf_tf.csc.ahead) in float64 for one pack, without wire rounding.

    A sparse step sends the chunks chosen at the previous step from the all-reduced scores;
    a dense (warm-up) step scores every chunk by the L1 norm of its sum."""

    def __init__(self, n, num_replicas, chunk_size, momentum=0.0, scoring="error_feedback"):
        self.pack = NumpyCSC(n, num_replicas, chunk_size, momentum)
        self.scoring = scoring
        self.scores = np.zeros(self.pack.c)
        self.bound = 0.0

    def step(self, g, density, warmup=False):
        """g: [replicas, n] -> (output [n], the chunks sent this step)."""
        p = self.pack
        g = np.asarray(g, np.float64)
        u = p.m * p.velocity + g if p.m else g
        acc = p.residual + u
        norms = np.array([p.chunk_norms(a) for a in acc])          # [replicas, C]
        total = acc.sum(0)
        if warmup:
            idx = np.arange(p.c)
            if np.all(np.isfinite(norms.sum(0))):
                p.velocity = u if p.m else p.velocity
                p.residual = np.zeros_like(acc)
                self.scores = p.chunk_norms(total)
                self.bound = norms.sum(0).max()
            return total, idx
        k = selected_chunk_count(p.c, density)
        key = np.where(np.isnan(self.scores), np.inf, self.scores)
        idx = np.sort(np.lexsort((np.arange(p.c), -key))[:k]) if k < p.c else np.arange(p.c)
        mask = np.repeat(np.isin(np.arange(p.c), idx), p.cs)[:p.n]
        out = np.where(mask, total, 0.0)
        residual = np.where(mask, 0.0, acc)
        velocity = (np.where(mask, 0.0, u) if k < p.c else u) if p.m else p.velocity
        if self.scoring == "error_feedback":
            scores = sum(p.chunk_norms(r + p.m * v) for r, v in zip(residual, velocity))
        else:
            scores = sum(p.chunk_norms(r) for r in residual)
            scores[idx] = p.chunk_norms(out)[idx]
        bound = norms.max(1).sum()
        if np.all(np.isfinite(out)) and np.all(np.isfinite(scores)) and np.isfinite(bound):
            p.residual, p.velocity, self.scores, self.bound = residual, velocity, scores, bound
        else:
            out = np.full_like(out, np.nan)
        return out, idx


def spread_gradients(rng, shapes, order, num_replicas, chunk_size):
    """Per replica a list of float32 gradients of `shapes` whose chunks (in pack `order`) have
    norms kept apart by a random permutation of scales from 0.1 to 10 (no float32-vs-float64
    near ties in top k)."""
    n = sum(int(np.prod(s)) for s in shapes)
    chunks = -(-n // chunk_size)
    scale = rng.permutation(np.repeat(np.linspace(0.1, 10.0, chunks), chunk_size)[:n])
    grads = []
    for _ in range(num_replicas):
        flat = (rng.normal(size=n) * scale).astype(np.float32)
        parts = np.split(flat, np.cumsum([int(np.prod(shapes[i])) for i in order])[:-1])
        by_index = dict(zip(order, parts))
        grads.append([by_index[i].reshape(shapes[i]) for i in range(len(shapes))])
    return grads
