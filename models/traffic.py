"""The bytes one replica puts into the gradient all-reduce, for models/train.py's summary and curve.

With GradientFlow they are its `CommStats`. For TensorFlow's own all-reduce (no GradientFlow) they
are counted from the gradients' structure: a dense gradient sends its elements in the all-reduce's
dtype, an `IndexedSlices` (an embedding's gradient) its rows in that dtype and its indices in
theirs, as TensorFlow's gather of them does; the float32 figure is the dense reference.
"""

from typing import List, Tuple

import keras
import numpy as np
import tensorflow as tf

WIDTH = {"float32": 4, "float16": 2}   # --tf_all_reduce_dtype: bytes per gradient element


def gradient_layout(model: keras.Model, per_replica_batch: int) -> List[Tuple[int, int]]:
    """Per trainable weight, what its gradient puts into TensorFlow's all-reduce: (elements,
    index bytes): a dense gradient its size and 0, an `IndexedSlices` rows x row elements and its
    indices' bytes.

    From one gradient of a clone of `model` (its own variables, outside any strategy) on a zero
    batch of `per_replica_batch` examples: an embedding's row count depends on the batch's
    shape, not its values. A model that cannot be cloned (a subclassed one) counts every
    weight dense."""
    try:
        clone = keras.models.clone_model(model)
    except (ValueError, TypeError):
        return [(int(np.prod(w.shape)), 0) for w in model.trainable_weights]
    spec = clone.inputs[0]
    batch = tf.zeros([per_replica_batch, *spec.shape[1:]], spec.dtype)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(clone(batch, training=False))
    layout = []
    for grad, weight in zip(tape.gradient(loss, clone.trainable_weights), clone.trainable_weights):
        if isinstance(grad, tf.IndexedSlices):
            rows = int(grad.indices.shape[0])
            layout.append((rows * int(np.prod(grad.values.shape[1:])), rows * grad.indices.dtype.size))
        else:
            layout.append((int(np.prod(weight.shape)), 0))
    return layout


def tf_bytes_per_step(model: keras.Model, per_replica_batch: int, tf_all_reduce_dtype: str) -> dict:
    """`bytes_per_step`'s figures for TensorFlow's own all-reduce in `tf_all_reduce_dtype`
    ("float32" or "float16"): bytes one replica sends a step (`gradient_layout`'s elements in
    that dtype plus the index bytes), and the same in float32 as the dense reference."""
    layout = gradient_layout(model, per_replica_batch)
    sent, dense = (sum(width * elements + index for elements, index in layout)
                   for width in (WIDTH[tf_all_reduce_dtype], WIDTH["float32"]))
    return {"sent_bytes_per_step": sent, "dense_bytes_per_step": dense,
            "last_epoch_sent_bytes_per_step": sent, "density": 1.0, "last_epoch_density": 1.0,
            "source": f"TF {tf_all_reduce_dtype} all-reduce"}


def bytes_sent(gradient_flow, steps: int, tf_bytes: dict) -> float:
    """Bytes this worker put into gradient all-reduces over `steps` steps: gf_tf's CommStats
    total, or `steps` x the sent bytes of `tf_bytes_per_step` (TensorFlow's own all-reduce)."""
    if gradient_flow is not None:
        return gradient_flow.stats.totals()["sent_bytes"]
    return float(steps * tf_bytes["sent_bytes_per_step"])


def bytes_per_step(gradient_flow, history) -> dict:
    """GradientFlow's per-replica bytes per step from its CommStats: sent, and float32 dense
    all-reduce of the same gradients; means over all steps (warm-up included) and over the
    last epoch (`history`: model.fit's, with `gf_tf.GradientFlowStats`' figures)."""
    result = dict(gradient_flow.stats.result())
    result["last_epoch_sent_bytes_per_step"] = history.history["gf_sent_bytes_per_step"][-1]
    result["last_epoch_density"] = history.history["gf_density"][-1]
    result["source"] = "gf_tf CommStats"
    return result
