"""The bytes of a GradientFlow checkpoint: how its meta and arrays are serialized.

Three encodings of one content, (meta: a JSON dict, arrays: {key: np.ndarray}):
- Keras's `save_own_variables`: "meta" as a uint8 array of the JSON (`encode_meta`), each array
  under its key.
- `.npz` bytes (`to_npz`): the same, written by `np.savez` (the side files of
  gf_tf.keras.backup, and older gf_tf's `tf.train.Checkpoint` string).
- A `tf.string` scalar (`to_string_tensor`), built with TF ops so that a `tf.function` can
  write it: `tf.io.serialize_tensor` of a 1-D string tensor holding the JSON meta, the JSON
  list of [key, dtype name], the optimizer's iterations (int64 scalar) and each array.
`parse` reads the last two back.

Meta formats: 2 records the reducer (its qualified class name and its `settings()`); 1 (gf_tf
before the reducer seam) recorded CSC's momentum correction instead, and is read as format 2
with `legacy_reducer` (`upgrade`).
"""

import io
import json
from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

FORMAT = 2
READS = (1, 2)
# Format 1 was written by gf_tf's one reducer with state before the reducer seam.
LEGACY_REDUCER = "gf_tf.csc.reducer.CSCReducer"

Content = Tuple[dict, Dict[str, np.ndarray]]


def encode_meta(meta: dict) -> np.ndarray:
    """The meta as a uint8 [bytes] array of its sorted-key JSON."""
    return np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()


def decode_meta(array) -> dict:
    """The meta dict of an `encode_meta` array."""
    return json.loads(np.asarray(array, np.uint8).tobytes().decode())


def to_npz(meta: dict, arrays: Dict[str, np.ndarray]) -> bytes:
    """`np.savez` bytes of "meta" (`encode_meta`) and the arrays by key."""
    buffer = io.BytesIO()
    np.savez(buffer, meta=encode_meta(meta), **arrays)
    return buffer.getvalue()


def to_string_tensor(meta: dict, tensors: Dict[str, tf.Tensor], iterations: tf.Tensor) -> tf.Tensor:
    """The content as a tf.string scalar, with TF ops (eager or in a tf.function).

    Args:
      meta: JSON-able dict, without "optimizer_iterations".
      tensors: {key: tensor}, any dtype and shape.
      iterations: int64 scalar, the optimizer's step counter.
    """
    with tf.device("/cpu:0"):
        keys = [[key, value.dtype.name] for key, value in tensors.items()]
        parts = [tf.constant(json.dumps(meta, sort_keys=True)), tf.constant(json.dumps(keys)),
                 tf.io.serialize_tensor(iterations)]
        parts += [tf.io.serialize_tensor(value) for value in tensors.values()]
        return tf.io.serialize_tensor(tf.stack(parts))


def parse(data: bytes) -> Content:
    """(meta with "optimizer_iterations", {key: array}) of `to_string_tensor`'s bytes or of
    `to_npz`'s (a zip: it starts with b"PK")."""
    if data[:2] == b"PK":
        loaded = np.load(io.BytesIO(data))
        return decode_meta(loaded["meta"]), {k: loaded[k] for k in loaded.files if k != "meta"}
    parts = tf.io.parse_tensor(data, tf.string).numpy()
    meta, keys = json.loads(parts[0]), json.loads(parts[1])
    meta["optimizer_iterations"] = int(tf.io.parse_tensor(parts[2], tf.int64))
    arrays = {key: tf.io.parse_tensor(part, tf.as_dtype(dtype)).numpy()
              for (key, dtype), part in zip(keys, parts[3:])}
    return meta, arrays


def upgrade(meta: dict) -> dict:
    """A format-1 meta as format 2: its reducer is `LEGACY_REDUCER` with settings unrecorded
    (None), and "momentum" dropped (the state's own arrays show it: a mismatch is caught when
    they are assigned). Other formats are returned as they are."""
    if meta.get("format") != 1:
        return meta
    meta = {key: value for key, value in meta.items() if key != "momentum"}
    return dict(meta, format=FORMAT, reducer={"class": LEGACY_REDUCER, "settings": None})
