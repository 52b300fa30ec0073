"""The all-reduce methods under comparison, by name, and the strategy each one needs.

    tf_fp32   TensorFlow's MultiWorkerMirroredStrategy, float32, RING (the baseline)
    tf_fp16   the same strategy, gradients cast to float16 by hand before the
              all-reduce and back after (separates the dtype from our overhead)
    gf_fp16   gf_tf.GradientFlowAllReduce(compression="fp16"), dense, in packs of
              gf_tf.cross_device_ops.DEFAULT_BYTES_PER_PACK (4 MiB) over TF's ring
    csc_10 / csc_1 / csc_0.1
              gf_tf.GradientFlowAllReduce(compression="fp16",
              sparsity=gf_tf.ChunkSparsity(density=0.1 / 0.01 / 0.001, warmup_steps=0)),
              4 MiB packs over TF's ring
    csc_auto  the same with ChunkSparsity(density="auto", warmup_steps=0): each step the
              largest density whose communication costs at most 5% of the measured compute
    csc_1_global / csc_0.1_global
              the same at density 0.01 / 0.001 with selection="global" (one top-K over
              the chunks of all packs instead of k per pack); not in the presets' loops
              over every method: ask for them with --methods
    auto      gf_tf.GradientFlowAllReduce() with its defaults (every setting "auto" but overlap): gf_tf's
              default, the planner's choice of method, pack size and algorithm (gf_tf.plan.planner)
    gf_fp16_rd / csc_1_rd
              gf_fp16 / csc_1 over recursive doubling (algorithm="recursive_doubling",
              gf_tf.collectives) instead of TF's ring
    gf_fp16_overlap
              gf_fp16 with overlap=True: one group of packs per pack, each with its own
              scale-bounds all-reduce, so packs leave during backprop; bytes_per_pack
              "auto" (the planner's pack size that gives 2 or more packs)
    csc_1_overlap
              csc_1 with overlap=True: each 4 MiB pack all-reduces its own chunk norms,
              then its own chunks, as soon as its gradients exist
    csc_1_ahead / csc_1_ahead_overlap / csc_1_ahead_rd
              csc_1 with selection="ahead" (each pack's chunks chosen at the step
              before: one collective a step), one barrier / with overlap=True / over
              recursive doubling
    csc_15_paper / csc_10_paper
              the GradientFlow paper's own settings: chunks of 32,000 elements (its "32K
              gradients"), 15% / 10% of them, chosen a step ahead with its scoring rule
    lowrank_1 / lowrank_2 / lowrank_4
              gf_tf.GradientFlowAllReduce(compression="fp16",
              reducer=gf_tf.reducers.LowRank(rank=1 / 2 / 4)): each matrix's gradient as two
              rank-r factors (PowerSGD), the rest dense; not in the presets' loops over every
              method: ask for them with --methods
    lowrank_2_acp
              lowrank_2 with LowRank(alternate=True): one factor all-reduce a step, the P's
              and the Q's in turn (ACP-SGD)

Every GradientFlow method pins bytes_per_pack, algorithm and overlap (False) unless its
OVERRIDES entry says otherwise (`auto` leaves them to the planner, the `_overlap` methods
turn overlap on), so that it measures the same transport whatever the planner's defaults.
The methods of OVERRIDES are not in the presets' loops over every method either: the
`scale` preset of benchmarks.allreduce names them.

A GradientFlow method's GradientFlowAllReduce keywords are PINNED, with its
sparsity (CSC_DENSITY, CSC_SELECTION), updated by its entry in OVERRIDES: the
one place a method's settings differ. A method named only in OVERRIDES joins
METHODS (outside the presets' loops), so measuring a new GradientFlowAllReduce
keyword is one line there, e.g. `"gf_fp16_overlap": {"overlap": True},`.
"""

from typing import Dict, Union

_BASE_METHODS = ["tf_fp32", "tf_fp16", "gf_fp16", "csc_10", "csc_1", "csc_0.1", "csc_auto",
                 "csc_1_global", "csc_0.1_global", "csc_1_ahead", "csc_15_paper", "csc_10_paper"]
CSC_DENSITY: Dict[str, Union[float, str]] = {"csc_10": 0.10, "csc_1": 0.01, "csc_0.1": 0.001,
                                             "csc_auto": "auto",
                                             "csc_1_global": 0.01, "csc_0.1_global": 0.001,
                                             "csc_1_rd": 0.01, "csc_1_overlap": 0.01,
                                             "csc_1_ahead": 0.01, "csc_1_ahead_overlap": 0.01,
                                             "csc_15_paper": 0.15, "csc_10_paper": 0.10,
                                             "csc_1_ahead_rd": 0.01}
# ChunkSparsity(selection=...) of the CSC methods not selecting per pack.
CSC_SELECTION: Dict[str, str] = {"csc_1_global": "global", "csc_0.1_global": "global",
                                 "csc_1_ahead": "ahead", "csc_1_ahead_overlap": "ahead",
                                 "csc_15_paper": "ahead", "csc_10_paper": "ahead",
                                 "csc_1_ahead_rd": "ahead"}
# Other ChunkSparsity keywords of a CSC method (its defaults otherwise).
CSC_EXTRA: Dict[str, Dict[str, object]] = {
    "csc_15_paper": {"chunk_size": 32000, "scoring": "paper"},
    "csc_10_paper": {"chunk_size": 32000, "scoring": "paper"},
}
# GradientFlowAllReduce keywords of every GradientFlow method ("default" bytes_per_pack:
# gf_tf.plan.DEFAULT_BYTES_PER_PACK, 4 MiB), before its OVERRIDES.
PINNED: Dict[str, object] = {"compression": "fp16", "bytes_per_pack": "default", "algorithm": "ring",
                             "overlap": False}
# Per method: the GradientFlowAllReduce keywords that differ from PINNED.
OVERRIDES: Dict[str, Dict[str, object]] = {
    "auto": {"compression": "auto", "bytes_per_pack": "auto", "algorithm": "auto"},  # the defaults
    "gf_fp16_overlap": {"overlap": True, "bytes_per_pack": "auto"},   # one group per pack, 2+ packs
    "gf_fp16_rd": {"algorithm": "recursive_doubling"},
    "csc_1_rd": {"algorithm": "recursive_doubling"},
    "csc_1_overlap": {"overlap": True},   # CSC 1%, each pack's norms and chunks on their own
    "csc_1_ahead_overlap": {"overlap": True},   # CSC 1% ahead, each pack's one collective on its own
    "csc_1_ahead_rd": {"algorithm": "recursive_doubling"},
}
# gf_tf.reducers.LowRank(rank=...) of the low-rank methods (PINNED's FP16 wire carries the factors).
LOWRANK_RANK: Dict[str, int] = {
    "lowrank_1": 1,
    "lowrank_2": 2,
    "lowrank_4": 4,
    "lowrank_2_acp": 2,
}
# The low-rank methods that send one factor a step (LowRank(alternate=True), ACP-SGD).
LOWRANK_ALTERNATE = ("lowrank_2_acp",)
METHODS = (_BASE_METHODS + [m for m in OVERRIDES if m not in _BASE_METHODS]
           + list(LOWRANK_RANK))
# The methods the presets loop over when they take "every method".
PRESET_METHODS = [m for m in METHODS if m not in CSC_SELECTION and m not in OVERRIDES
                  and m not in LOWRANK_RANK]
LABELS = {
    "tf_fp32": "TF default fp32",
    "tf_fp16": "TF default, fp16 by hand",
    "gf_fp16": "GradientFlow fp16 dense",
    "csc_10": "GradientFlow CSC 10%",
    "csc_1": "GradientFlow CSC 1%",
    "csc_0.1": "GradientFlow CSC 0.1%",
    "csc_auto": "GradientFlow CSC auto",
    "csc_1_global": "GradientFlow CSC 1% global",
    "csc_0.1_global": "GradientFlow CSC 0.1% global",
    "auto": "gf_tf default (planner)",
    "gf_fp16_rd": "GradientFlow fp16, recursive doubling",
    "csc_1_rd": "GradientFlow CSC 1%, recursive doubling",
    "csc_1_overlap": "GradientFlow CSC 1%, a group per pack",
    "csc_1_ahead": "GradientFlow CSC 1%, chosen a step ahead",
    "csc_1_ahead_overlap": "GradientFlow CSC 1% ahead, a group per pack",
    "csc_1_ahead_rd": "GradientFlow CSC 1% ahead, recursive doubling",
    "csc_15_paper": "GradientFlow CSC 15%, chunks of 32,000, ahead (the paper's)",
    "csc_10_paper": "GradientFlow CSC 10%, chunks of 32,000, ahead (the paper's)",
    **{m: f"GradientFlow low-rank (PowerSGD), rank {r}" for m, r in LOWRANK_RANK.items()},
    "lowrank_2_acp": "GradientFlow low-rank, rank 2, P and Q in turn (ACP-SGD)",
}
for _m in [m for m in OVERRIDES if m not in LABELS]:   # a method added by one OVERRIDES line:
    LABELS[_m] = "GradientFlow " + ", ".join(f"{k}={v!r}" for k, v in OVERRIDES[_m].items())   # its keywords


def csc_selection(method: str) -> str:
    """ChunkSparsity(selection=...) of a CSC method: "global", "ahead" or "per_pack"."""
    return CSC_SELECTION.get(method, "per_pack")


def algorithm(method: str) -> str:
    """GradientFlowAllReduce(algorithm=...) of a GradientFlow method: "ring", "recursive_doubling"
    or "auto" (the planner's)."""
    return str(gradient_flow_settings(method)["algorithm"])


def is_gradient_flow(method: str) -> bool:
    return (method.startswith("gf_") or method in CSC_DENSITY or method in OVERRIDES
            or method in LOWRANK_RANK)


def gradient_flow_settings(method: str) -> Dict[str, object]:
    """PINNED updated by OVERRIDES[method]: the GradientFlowAllReduce keywords of a
    GradientFlow method, without its sparsity (no TensorFlow import)."""
    return {**PINNED, **OVERRIDES.get(method, {})}


def gradient_flow_kwargs(method: str) -> Dict[str, object]:
    """The GradientFlowAllReduce keywords of a GradientFlow method, sparsity or reducer included
    (a new gf_tf.ChunkSparsity or LowRank each call)."""
    import gf_tf
    from gf_tf.plan import DEFAULT_BYTES_PER_PACK
    kwargs = gradient_flow_settings(method)
    if kwargs["bytes_per_pack"] == "default":
        kwargs["bytes_per_pack"] = DEFAULT_BYTES_PER_PACK
    if method in CSC_DENSITY:
        kwargs["sparsity"] = gf_tf.ChunkSparsity(density=CSC_DENSITY[method], warmup_steps=0,
                                                 selection=csc_selection(method),
                                                 **CSC_EXTRA.get(method, {}))
    if method in LOWRANK_RANK:
        kwargs["reducer"] = gf_tf.reducers.LowRank(rank=LOWRANK_RANK[method],
                                                   alternate=method in LOWRANK_ALTERNATE)
    return kwargs


def largest_density(method: str) -> float:
    """The most a CSC method may send, as a fraction (for time budgets): "auto" -> its top rung."""
    density = CSC_DENSITY[method]
    return 1.0 if density == "auto" else density   # gf_tf.csc.AUTO_LADDER[0]: a dense step


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
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
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
