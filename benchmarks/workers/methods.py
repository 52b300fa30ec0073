"""The all-reduce methods under comparison, by name, and the strategy each one needs.

    tf_fp32   TensorFlow's MultiWorkerMirroredStrategy, float32, RING (the baseline)
    tf_fp16   the same strategy, gradients cast to float16 by hand before the
              all-reduce and back after (separates the dtype from our overhead)
    gf_fp16   gf_tf.GradientFlowAllReduce(compression="fp16"), dense
    csc_10 / csc_1 / csc_0.1
              gf_tf.GradientFlowAllReduce(compression="fp16",
              sparsity=gf_tf.ChunkSparsity(density=0.1 / 0.01 / 0.001, warmup_steps=0))
    csc_auto  the same with ChunkSparsity(density="auto", warmup_steps=0): each step the
              largest density whose communication costs at most 5% of the measured compute
    csc_1_global / csc_0.1_global
              the same at density 0.01 / 0.001 with selection="global" (one top-K over
              the chunks of all packs instead of k per pack); not in the presets' loops
              over every method: ask for them with --methods
"""

from typing import Dict, Optional, Union

METHODS = ["tf_fp32", "tf_fp16", "gf_fp16", "csc_10", "csc_1", "csc_0.1", "csc_auto",
           "csc_1_global", "csc_0.1_global"]
CSC_DENSITY: Dict[str, Union[float, str]] = {"csc_10": 0.10, "csc_1": 0.01, "csc_0.1": 0.001,
                                             "csc_auto": "auto",
                                             "csc_1_global": 0.01, "csc_0.1_global": 0.001}
# ChunkSparsity(selection=...) of the CSC methods not selecting per pack.
CSC_SELECTION: Dict[str, str] = {"csc_1_global": "global", "csc_0.1_global": "global"}
# The methods the presets loop over when they take "every method".
PRESET_METHODS = [m for m in METHODS if m not in CSC_SELECTION]
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
}


def csc_selection(method: str) -> str:
    """ChunkSparsity(selection=...) of a CSC method: "global" or "per_pack"."""
    return CSC_SELECTION.get(method, "per_pack")


def is_gradient_flow(method: str) -> bool:
    return method.startswith("gf_") or method in CSC_DENSITY


def largest_density(method: str) -> float:
    """The most a CSC method may send, as a fraction (for time budgets): "auto" -> its top rung."""
    density = CSC_DENSITY[method]
    return 0.25 if density == "auto" else density   # gf_tf.sparsity.AUTO_LADDER[0]


def make_strategy(method: str, timeout_seconds: float, keras_fit: bool = False,
                  build_strategy: bool = True):
    """Returns (strategy, gradient_flow or None) for `method`.

    Every method uses RING collectives with a timeout. With keras_fit=True the
    TF default goes through gf_tf.MultiWorkerMirroredStrategy(gradient_flow=None)
    so that Keras 3 `fit` works under multi-worker (keras-team/keras#20585);
    the all-reduce itself is then TensorFlow's. With build_strategy=False the
    strategy is None (the GradientFlowAllReduce alone, e.g. for local timing).
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
            return gf_tf.MultiWorkerMirroredStrategy(communication_options=options, gradient_flow=None), None
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options), None
    import gf_tf
    sparsity: Optional[object] = None
    if method in CSC_DENSITY:
        sparsity = gf_tf.ChunkSparsity(density=CSC_DENSITY[method], warmup_steps=0,
                                       selection=csc_selection(method))
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", sparsity=sparsity)
    if not build_strategy:
        return None, gradient_flow
    strategy = gf_tf.MultiWorkerMirroredStrategy(communication_options=options, gradient_flow=gradient_flow)
    return strategy, gradient_flow
