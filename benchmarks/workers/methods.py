"""The all-reduce methods under comparison: one table (TABLE), everything else derived from it.

Each `Method` entry holds its name, label and the settings that differ from the pinned transport
(GradientFlowAllReduce(**PINNED)). From an entry come `gradient_flow_kwargs` (benchmarks.allreduce,
benchmarks.fit), `trainer_flags` (benchmarks.convergence), `traffic` / `payload_bytes` (the one byte
model, from gf_tf's own pack plan, chunk counts and LowRank layout), `LABELS`, `METHODS`,
`PRESET_METHODS` and `CONVERGENCE_METHODS`. A new method is one entry, e.g. `Method("csc_5",
"GradientFlow CSC 5%", csc={"density": 0.05})`, or `register(...)` of it from outside; "auto" reads
as "default" (`canonical`). More: docs/benchmarks.md, "The tools in detail".
"""

import dataclasses
import functools
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

ALLREDUCE, CONVERGENCE = "allreduce", "convergence"   # the presets' loops a method joins
ALIASES = {"auto": "default"}   # old name -> name
# GradientFlowAllReduce keywords of every GradientFlow method before its own ("default"
# bytes_per_pack: gf_tf.plan.DEFAULT_BYTES_PER_PACK, 4 MiB).
PINNED: Dict[str, object] = {"compression": "fp16", "bytes_per_pack": "default", "algorithm": "ring",
                             "overlap": False}
_AUTO = {"compression": "auto", "bytes_per_pack": "auto", "algorithm": "auto"}   # the planner's


@dataclasses.dataclass(frozen=True)
class Method:
    """One all-reduce configuration.

    tf_dtype: TensorFlow's own all-reduce in this dtype ("float32" or "float16": cast by
      hand and back); None: GradientFlow.
    gradient_flow: the GradientFlowAllReduce keywords that differ from PINNED.
    csc: gf_tf.ChunkSparsity keywords (density, selection, chunk_size, scoring, momentum),
      warm-up excluded; None: no CSC.
    lowrank: gf_tf.reducers.LowRank keywords (rank, alternate); None: no low rank.
    local: models.train's --sync_every H and --outer ("average", "nesterov"): LocalSGD; None: synchronous.
    presets: the presets' loops that take it (ALLREDUCE, CONVERGENCE).
    """
    name: str
    label: str
    tf_dtype: Optional[str] = None
    gradient_flow: Mapping[str, object] = dataclasses.field(default_factory=dict)
    csc: Optional[Mapping[str, object]] = None
    lowrank: Optional[Mapping[str, object]] = None
    presets: frozenset = frozenset()
    local: Optional[Mapping[str, object]] = None


_BOTH, _ALLREDUCE, _CONVERGENCE = frozenset({ALLREDUCE, CONVERGENCE}), frozenset({ALLREDUCE}), frozenset({CONVERGENCE})
_ENTRIES = [
    # TensorFlow's MultiWorkerMirroredStrategy, float32, RING (the baseline).
    Method("tf_fp32", "TF default fp32", tf_dtype="float32", presets=_BOTH),
    # The same strategy, gradients cast to float16 by hand before the all-reduce and back
    # after (separates the dtype from our overhead).
    Method("tf_fp16", "TF default, fp16 by hand", tf_dtype="float16", presets=_BOTH),
    # Dense FP16 packs of 4 MiB over TF's ring.
    Method("gf_fp16", "GradientFlow fp16 dense", presets=_BOTH),
    # gf_tf.GradientFlowAllReduce() with its defaults (every setting "auto" but overlap):
    # the planner's choice of method, pack size and algorithm (gf_tf.plan.planner).
    Method("default", "gf_tf default (planner)", gradient_flow=_AUTO, presets=_CONVERGENCE),
    # CSC at density 0.1 / 0.01 / 0.001, top-k per pack: two collectives (norms, chunks).
    Method("csc_10", "GradientFlow CSC 10%", csc={"density": 0.10}, presets=_ALLREDUCE),
    Method("csc_1", "GradientFlow CSC 1%", csc={"density": 0.01}, presets=_BOTH),
    Method("csc_0.1", "GradientFlow CSC 0.1%", csc={"density": 0.001}, presets=_ALLREDUCE),
    # csc_1 with each pack's chunks chosen at the step before: one collective a step.
    Method("csc_1_ahead", "GradientFlow CSC 1%, chosen a step ahead",
           csc={"density": 0.01, "selection": "ahead"}, presets=_CONVERGENCE),
    # ChunkSparsity(density="auto"), ChunkSparsity()'s default: dense while the gradient's norm
    # changes fast or where compressing saves under 25% of a step, else the density the link affords.
    Method("csc_auto", "GradientFlow CSC auto", csc={"density": "auto"}, presets=_BOTH),
    # csc_1 with the paper's (DGC's) momentum correction in ChunkSparsity(momentum=0.9)
    # (models.train --momentum_correction: the optimizer then runs plain SGD).
    Method("csc_1_mc", "GradientFlow CSC 1%, momentum correction",
           csc={"density": 0.01, "momentum": 0.9}),
    # One top-K over the chunks of all packs instead of k per pack.
    Method("csc_1_global", "GradientFlow CSC 1% global", csc={"density": 0.01, "selection": "global"}),
    Method("csc_0.1_global", "GradientFlow CSC 0.1% global",
           csc={"density": 0.001, "selection": "global"}),
    # The GradientFlow paper's settings: chunks of 32,000 elements (its "32K gradients"),
    # 15% / 10% of them, chosen a step ahead with its scoring rule.
    Method("csc_15_paper", "GradientFlow CSC 15%, chunks of 32,000, ahead (the paper's)",
           csc={"density": 0.15, "selection": "ahead", "chunk_size": 32000, "scoring": "paper"}),
    Method("csc_10_paper", "GradientFlow CSC 10%, chunks of 32,000, ahead (the paper's)",
           csc={"density": 0.10, "selection": "ahead", "chunk_size": 32000, "scoring": "paper"}),
    # gf_fp16 / csc_1 / csc_1_ahead over recursive doubling (gf_tf.collectives), not TF's ring.
    Method("gf_fp16_rd", "GradientFlow fp16, recursive doubling",
           gradient_flow={"algorithm": "recursive_doubling"}),
    Method("csc_1_rd", "GradientFlow CSC 1%, recursive doubling",
           gradient_flow={"algorithm": "recursive_doubling"}, csc={"density": 0.01}),
    Method("csc_1_ahead_rd", "GradientFlow CSC 1% ahead, recursive doubling",
           gradient_flow={"algorithm": "recursive_doubling"}, csc={"density": 0.01, "selection": "ahead"}),
    # overlap=True: one group per pack, each with its own scale-bounds all-reduce, so packs
    # leave during backprop; gf_fp16's at the planner's pack size (2 or more packs).
    Method("gf_fp16_overlap", "GradientFlow fp16, a group per pack",
           gradient_flow={"overlap": True, "bytes_per_pack": "auto"}),
    # Each 4 MiB pack all-reduces its own chunk norms, then its own chunks / its one collective.
    Method("csc_1_overlap", "GradientFlow CSC 1%, a group per pack",
           gradient_flow={"overlap": True}, csc={"density": 0.01}),
    Method("csc_1_ahead_overlap", "GradientFlow CSC 1% ahead, a group per pack",
           gradient_flow={"overlap": True}, csc={"density": 0.01, "selection": "ahead"}),
    # Each matrix's gradient as two rank-r factors (PowerSGD), the rest dense, on the FP16 wire.
    *[Method(f"lowrank_{r}", f"GradientFlow low-rank (PowerSGD), rank {r}", lowrank={"rank": r},
             presets=_CONVERGENCE if r == 2 else frozenset()) for r in (1, 2, 4)],
    # lowrank_2 sending one factor a step, the P's and the Q's in turn (ACP-SGD).
    Method("lowrank_2_acp", "GradientFlow low-rank, rank 2, P and Q in turn (ACP-SGD)",
           lowrank={"rank": 2, "alternate": True}),
    # 8 steps alone, then averaging (post-local SGD) or DiLoCo's outer Nesterov step (gf_tf.keras.LocalSGD).
    Method("local_8", "GradientFlow local SGD, averaging every 8", local={"sync_every": 8, "outer": "average"}),
    Method("diloco_8", "GradientFlow DiLoCo, Nesterov every 8", local={"sync_every": 8, "outer": "nesterov"}),
    # diloco_8 / local_H with CSC 10% on the pseudo-gradient (its own residual; SparseLoCo's idea).
    Method("diloco_8_csc", "GradientFlow DiLoCo every 8, CSC 10% on the pseudo-gradient",
           local={"sync_every": 8, "outer": "nesterov"}, csc={"density": 0.1}),
    *[Method(f"local_{h}_csc", f"GradientFlow local SGD every {h}, CSC 10% on the pseudo-gradient",
             local={"sync_every": h, "outer": "average"}, csc={"density": 0.1}) for h in (8, 16, 32)],
    # local_8 with ChunkSparsity()'s default on the pseudo-gradient: dense where compressing does not pay.
    Method("local_8_auto", "GradientFlow local SGD every 8, CSC auto on the pseudo-gradient",
           local={"sync_every": 8, "outer": "average"}, csc={"density": "auto"}),
    # The sweep over H (docs/local-sgd.md): averaging every 2 to 64 steps.
    *[Method(f"local_{h}", f"GradientFlow local SGD, averaging every {h}",
             local={"sync_every": h, "outer": "average"}) for h in (2, 4, 16, 32, 64)],
]
TABLE: Dict[str, Method] = {}
METHODS: List[str] = []   # TABLE's names in order (list views, kept current by register)
PRESET_METHODS: List[str] = []
CONVERGENCE_METHODS: List[str] = []
LABELS: Dict[str, str] = {}


def register(method: Method) -> Method:
    """Adds `method` to TABLE and the lists derived from it (after the others).

    Raises ValueError for a name already taken (or an alias), or a method that is both TF's
    all-reduce and GradientFlow's."""
    if method.name in TABLE or method.name in ALIASES:
        raise ValueError(f"method {method.name!r} is already in the table")
    if method.tf_dtype is not None and (method.gradient_flow or method.csc or method.lowrank):
        raise ValueError(f"{method.name}: tf_dtype is TensorFlow's own all-reduce; it takes no "
                         f"GradientFlow setting")
    if method.csc is not None and method.lowrank is not None:
        raise ValueError(f"{method.name}: CSC and low rank do not combine")
    _traffic.cache_clear()
    TABLE[method.name] = method
    METHODS.append(method.name)
    LABELS[method.name] = method.label
    for names, preset in ((PRESET_METHODS, ALLREDUCE), (CONVERGENCE_METHODS, CONVERGENCE)):
        if preset in method.presets:
            names.append(method.name)
    return method


def unregister(name: str) -> None:
    """Removes the method `name` from TABLE and its lists (a test's own entry)."""
    _traffic.cache_clear()
    del TABLE[name], LABELS[name]
    for names in (METHODS, PRESET_METHODS, CONVERGENCE_METHODS):
        if name in names:
            names.remove(name)


def canonical(name: str) -> str:
    """The table's name of `name` ("auto" -> "default"); other names unchanged."""
    return ALIASES.get(name, name)


def get(name: str) -> Method:
    """The table's entry of `name` (or of its alias). Raises ValueError for an unknown name."""
    try:
        return TABLE[canonical(name)]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {METHODS}") from None


def parse(text: str, flag: str = "--methods") -> List[str]:
    """Comma-separated method names -> the table's names (aliases mapped). Raises SystemExit
    naming `flag` for an unknown one."""
    items = [canonical(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in TABLE]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {METHODS}")
    return items


def is_gradient_flow(name: str) -> bool:
    """True for a GradientFlow method, False for TensorFlow's own all-reduce."""
    return get(name).tf_dtype is None


def is_csc(name: str) -> bool:
    return get(name).csc is not None


def density(name: str):
    """A CSC method's ChunkSparsity density (a fraction or "auto"); None for the others."""
    csc = get(name).csc
    return None if csc is None else csc["density"]


def csc_selection(name: str) -> str:
    """ChunkSparsity(selection=...) of a CSC method: "per_pack" (its default), "global" or "ahead"."""
    return str(get(name).csc.get("selection", "per_pack"))


def gradient_flow_settings(name: str) -> Dict[str, object]:
    """PINNED updated by the method's `gradient_flow`: its GradientFlowAllReduce keywords without
    sparsity or reducer (no TensorFlow import; bytes_per_pack may be "default")."""
    return {**PINNED, **get(name).gradient_flow}


def algorithm(name: str) -> str:
    """GradientFlowAllReduce(algorithm=...) of a method: "ring" (TF's methods too),
    "recursive_doubling" or "auto" (the planner's)."""
    return str(gradient_flow_settings(name)["algorithm"])


def _pinned_settings(name: str) -> Dict[str, object]:
    """gradient_flow_settings with "default" bytes_per_pack as gf_tf.plan.DEFAULT_BYTES_PER_PACK."""
    from gf_tf.plan import DEFAULT_BYTES_PER_PACK
    settings = gradient_flow_settings(name)
    if settings["bytes_per_pack"] == "default":
        settings["bytes_per_pack"] = DEFAULT_BYTES_PER_PACK
    return settings


def gradient_flow_kwargs(name: str, warmup_steps: int = 0) -> Dict[str, object]:
    """The GradientFlowAllReduce keywords of a GradientFlow method, sparsity or reducer included
    (a new gf_tf.ChunkSparsity(warmup_steps=warmup_steps, ...) or LowRank(warmup_steps=...)
    each call). csc_1_mc's momentum correction is ChunkSparsity(momentum=0.9) here too.

    Raises ValueError for an unknown method or one of TensorFlow's own all-reduce."""
    import gf_tf
    method = get(name)
    if method.tf_dtype is not None:
        raise ValueError(f"{name} is TensorFlow's own all-reduce: no GradientFlowAllReduce")
    kwargs = _pinned_settings(name)
    if method.csc is not None:
        kwargs["sparsity"] = gf_tf.ChunkSparsity(warmup_steps=warmup_steps, **method.csc)
    if method.lowrank is not None:
        kwargs["reducer"] = gf_tf.reducers.LowRank(warmup_steps=warmup_steps, **method.lowrank)
    return kwargs


# ChunkSparsity keyword -> its models.train flag (momentum: --momentum_correction, below).
_CSC_FLAGS = {"density": "--density", "selection": "--selection", "chunk_size": "--chunk_size",
              "scoring": "--scoring"}


def trainer_flags(name: str) -> List[str]:
    """The `python -m models.train` flags of the method: the same GradientFlowAllReduce as
    `gradient_flow_kwargs` (PINNED included), the CSC warm-up left at the trainer's default
    (--warmup_steps is not given; 0 for a reducer on local SGD's pseudo-gradient). A CSC
    `momentum` m is `--momentum_correction --momentum m`.

    Raises ValueError for an unknown method or a ChunkSparsity / LowRank keyword that
    models.train has no flag for."""
    method = get(name)
    if method.tf_dtype is not None:
        dtype = [] if method.tf_dtype == "float32" else ["--tf_all_reduce_dtype", method.tf_dtype]
        return ["--compression", "none", "--density", "1", *dtype]
    settings = _pinned_settings(name)
    overlap = settings["overlap"]
    flags = ["--compression", "none" if settings["compression"] is None else str(settings["compression"]),
             "--bytes_per_pack", str(settings["bytes_per_pack"]), "--algorithm", str(settings["algorithm"]),
             "--overlap", str(overlap).lower() if isinstance(overlap, bool) else str(overlap)]
    csc = dict(method.csc or {"density": 1})
    if "momentum" in csc:
        flags += ["--momentum_correction", "--momentum", str(csc.pop("momentum"))]
    unknown = set(csc) - set(_CSC_FLAGS)
    lowrank = dict(method.lowrank or {})
    unknown |= {f"LowRank {k}" for k in set(lowrank) - {"rank", "alternate"}}
    if unknown:
        raise ValueError(f"{name}: models.train has no flag for {sorted(unknown)}")
    flags += [x for key, value in csc.items() for x in (_CSC_FLAGS[key], str(value))]
    if method.lowrank is not None:
        flags += ["--reducer", "lowrank", "--rank", str(lowrank["rank"])]
        flags += ["--lowrank_alternate"] if lowrank.get("alternate") else []
    if method.local is not None and (method.csc is not None or method.lowrank is not None):
        flags += ["--warmup_steps", "0"]   # the reducer counts meetings: a warm-up would last H times as long
    return flags + [x for key, value in (method.local or {}).items() for x in (f"--{key}", str(value))]


# -- the byte model -------------------------------------------------------------------------

def traffic(name: str, shapes: Sequence[Sequence[int]], bytes_per_pack: Optional[int] = None
            ) -> Tuple[float, int]:
    """(payload bytes a worker puts into collectives per step, collectives per step) of the
    method on float32 gradients of these shapes, from gf_tf's own pack plan
    (`gf_tf.packing.plan_packs` on the FP16 wire), chunk counts and LowRank layout.

    TF's methods: 4 (float32) or 2 (float16) bytes an element in one collective (TF's batch
    all-reduce concatenates). FP16 packs (the dense reducer, scaled a step ahead): 2 bytes an
    element and `wire.ahead_slots(T)` FP16 slots per pack of T tensors, a collective per pack
    (its float32 retries left out). CSC: the selected chunks (2 bytes an element)
    and per chunk a float32 norm (2 collectives), or with selection "ahead" chunks, next scores
    and a bound per pack in one FP16 buffer (1 collective); density "auto" (chosen at run time)
    is taken at its largest rung, 1.0 (dense chunks). Low rank: `_lowrank_traffic`. Settings
    left "auto" (the default method) are modelled as FP16 packs of DEFAULT_BYTES_PER_PACK (the
    planner may choose TF's float32 instead); overlap's extra control all-reduces are left out.
    Local SGD: one meeting's all-reduce (of the method's kind) every H steps, bytes / H.

    bytes_per_pack: None for the method's own. Raises ValueError for a compression other than
    fp16 or "auto" (no byte model for it)."""
    return _traffic(canonical(name), tuple(tuple(int(d) for d in s) for s in shapes), bytes_per_pack)


def payload_bytes(name: str, shapes: Sequence[Sequence[int]]) -> float:
    """Bytes a worker puts into gradient all-reduces per step (`traffic`'s first figure)."""
    return traffic(name, shapes)[0]


@functools.lru_cache(maxsize=512)
def _traffic(name: str, shapes, bytes_per_pack: Optional[int]) -> Tuple[float, int]:
    payload, collectives = _one_all_reduce(name, shapes, bytes_per_pack)
    return payload / (get(name).local or {}).get("sync_every", 1), collectives   # local SGD: every H steps


def _one_all_reduce(name: str, shapes, bytes_per_pack: Optional[int]) -> Tuple[float, int]:
    method = get(name)
    elements = sum(math.prod(s) for s in shapes)
    if method.tf_dtype is not None:   # no TensorFlow import for TF's own
        return (4.0 if method.tf_dtype == "float32" else 2.0) * elements, 1
    import tensorflow as tf
    from gf_tf import packing, wire
    from gf_tf.csc import DEFAULT_CHUNK_SIZE, selected_chunk_count
    from gf_tf.plan import DEFAULT_BYTES_PER_PACK
    settings = gradient_flow_settings(name)
    if settings["compression"] not in ("fp16", "auto"):
        raise ValueError(f"{name}: no byte model for compression={settings['compression']!r}")
    if bytes_per_pack is None:
        bytes_per_pack = settings["bytes_per_pack"]
        bytes_per_pack = DEFAULT_BYTES_PER_PACK if bytes_per_pack in ("default", "auto") else bytes_per_pack
    specs = packing.plan_packs([(tf.TensorShape(s), tf.float32) for s in shapes], bytes_per_pack, wire.FP16)
    if method.lowrank is not None:
        return _lowrank_traffic(method, specs)
    if method.csc is None:   # packs with their slots (gf_tf.reducers.dense)
        return 2.0 * (elements + sum(wire.ahead_slots(len(s.shapes)) for s in specs)), len(specs)
    fraction = 1.0 if density(name) == "auto" else float(density(name))   # "auto": its dense top rung
    chunk_size = int(method.csc.get("chunk_size", DEFAULT_CHUNK_SIZE))
    chunks = [math.ceil(spec.num_elements / chunk_size) for spec in specs]
    if csc_selection(name) == "global":   # one top K over all chunks (one wire dtype)
        selected = selected_chunk_count(sum(chunks), fraction)
    else:
        selected = sum(selected_chunk_count(c, fraction) for c in chunks)
    if csc_selection(name) == "ahead":   # chunks, next scores and bound: one FP16 buffer
        return 2.0 * selected * chunk_size + 2.0 * (sum(chunks) + len(specs)), 1
    return 2.0 * selected * chunk_size + 4.0 * sum(chunks), 2   # the norms' and the chunks' all-reduces


def _lowrank_traffic(method: Method, specs) -> Tuple[float, int]:
    """(payload bytes, collectives) of a low-rank method on an FP16 wire, from its
    `gf_tf.reducers.LowRank`'s own layout of the packs: the factors (`LowRank.factor_elements`,
    2 bytes each), the dense remainder (2 bytes an element, one collective per pack that has
    one) and the float32 control vector (a bound per dense tensor, two per matrix) with its
    collective."""
    from gf_tf import reducers
    reducer = reducers.LowRank(**method.lowrank)
    factors, dense, bounds, dense_packs = 0.0, 0, 0, 0
    for spec in specs:
        layout = reducer.layout(spec)
        factors += reducer.factor_elements(layout)
        dense += sum(int(spec.shapes[i].num_elements()) for i in layout.dense)
        bounds += len(layout.dense) + 2 * len(layout.matrices)
        dense_packs += bool(layout.dense)
    collectives = dense_packs + (reducer.factor_all_reduces if factors else 0) + 1
    return 2.0 * (factors + dense) + 4.0 * bounds, collectives


def make_strategy(method: str, timeout_seconds: float, keras_fit: bool = False,
                  build_strategy: bool = True, heartbeat_timeout: float = None):
    """Returns (strategy, gradient_flow or None) for `method`.

    Every method uses RING collectives with a timeout. With keras_fit=True the
    TF default goes through gf_tf.MultiWorkerMirroredStrategy(gradient_flow=None)
    so that Keras 3 `fit` works under multi-worker (keras-team/keras#20585);
    the all-reduce itself is then TensorFlow's. With build_strategy=False the
    strategy is None (the GradientFlowAllReduce alone, e.g. for local timing).
    heartbeat_timeout: gf_tf.MultiWorkerMirroredStrategy's (None: TensorFlow's 10 s).
    """
    import tensorflow as tf
    method = get(method).name   # ValueError for an unknown one
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=timeout_seconds)
    if not is_gradient_flow(method):
        if keras_fit:
            import gf_tf
            return gf_tf.MultiWorkerMirroredStrategy(communication_options=options, gradient_flow=None,
                                                     heartbeat_timeout=heartbeat_timeout), None
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options), None
    import gf_tf
    gradient_flow = gf_tf.GradientFlowAllReduce(**gradient_flow_kwargs(method))
    if not build_strategy:
        return None, gradient_flow
    strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=options, gradient_flow=gradient_flow,
                                                 heartbeat_timeout=heartbeat_timeout)
    return strategy, gradient_flow


for _entry in _ENTRIES:   # here, after the functions register uses
    register(_entry)
