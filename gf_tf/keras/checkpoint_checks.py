"""Does a checkpoint's reducer state fit this run? The checks and messages of gf_tf.keras.checkpoint.

Every check runs when the checkpoint is read (`load_weights`, `tf.train.Checkpoint.read`,
`BackupAndRestore`), before the first step: the meta of a checkpoint records the reducer
(its class and its `settings()`, `reducer_meta`), per variable set the gradient signature its
pack plan came from, and the settings that shape the plan (compression, bytes_per_pack), so
the reducer is compared and the plan this run would build is computed here and compared.
Checkpoints written before the signature was recorded are checked at the first step
(`gf_tf.keras.checkpoint.GradientFlowCheckpoint._apply`).

Keras's `load_weights` collects the errors of every object it loads and raises "A total of N
objects could not be loaded" with them inside; `put_gf_tf_first` (a patch of
`saving_lib._raise_loading_failure`, gf_tf.keras.patches) puts gf_tf's explanation first.
"""

import json
from typing import List, Optional, Sequence

import tensorflow as tf

from gf_tf.reducers import Reducer
from gf_tf.state import describe

CHIEF_RECIPE = ("to load a file only the chief saved (TF's multi-worker guide: ModelCheckpoint on "
                "the chief) on every worker, call gf_tf.keras.backup.load_weights_from_chief(model, "
                "path) instead of model.load_weights(path): the chief's weights and optimizer, "
                "this worker's reducer state (CSC: residuals and momentum) from zero (warned)")


class CheckpointMismatchError(ValueError):
    """The checkpoint's reducer state does not fit this run (another worker count, replica count,
    worker's file, variable list, pack plan, reducer or reducer settings); the message says which."""


def check(condition: bool, why: str) -> None:
    """Raises CheckpointMismatchError("gf_tf: cannot restore the checkpoint's reducer state: WHY.")."""
    if not condition:
        raise CheckpointMismatchError(f"gf_tf: cannot restore the checkpoint's reducer state: {why}.")


def keeps_state(reducer: Reducer) -> bool:
    """True if `reducer` declares state (its class overrides `Reducer.create_states`)."""
    return type(reducer).create_states is not Reducer.create_states


def reducer_meta(reducer: Reducer) -> dict:
    """{"class": the reducer's qualified class name, "settings": [[name, number], ...] of its
    `state_settings()`} (JSON values), as saved in the meta."""
    cls = type(reducer)
    settings = [[name, number] for name, number, _ in reducer.state_settings()]
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "settings": json.loads(json.dumps(settings))}


def check_reducer(saved: dict, reducer: Reducer) -> None:
    """Raises CheckpointMismatchError naming both reducers (class and state settings, as the
    handshake prints them) unless the saved reducer is `reducer`'s class and every state setting
    (`Reducer.state_settings`) saved under a name it still has is equal. Settings saved as None
    (format 1) and saved names the reducer no longer declares (a checkpoint that recorded every
    handshake setting) are not compared: the state's arrays are checked when assigned."""
    now = reducer_meta(reducer)
    current = dict(now["settings"])
    same = saved["class"] == now["class"] and all(
        current[name] == number for name, number in saved["settings"] or () if name in current)
    printers = {name: text for name, _, text in reducer.state_settings()}

    def shown(meta):
        if meta["settings"] is None:
            return meta["class"]
        return meta["class"] + "(" + ", ".join(
            f"{name} {printers.get(name, repr)(number)}" for name, number in meta["settings"]) + ")"
    check(same, f"it was saved by the reducer {shown(saved)} and this run's is {shown(now)}. "
                f"Resume with the same reducer and settings")


def settings_of(gradient_flow) -> dict:
    """The GradientFlowAllReduce settings that shape the pack plan, as saved in the meta."""
    compression = gradient_flow.compression
    return {"compression": getattr(compression, "name", compression),
            "bytes_per_pack": gradient_flow.bytes_per_pack}


def pack_keys(specs) -> List[list]:
    """[[key, num_elements], ...] of PackSpecs (a pack plan), as the meta records them."""
    return [[p.key, p.num_elements] for p in specs]


def pack_keys_of(state) -> List[list]:
    """`pack_keys` of a `gf_tf.state.VariableSetState`'s pack plan."""
    return pack_keys(state.pack_specs)


def signature_to_json(signature) -> List[Optional[list]]:
    """A VariableSetState.signature as JSON: per gradient [dims, dtype name] or None (not packed)."""
    return [None if entry is None else [tf.TensorShape(entry[0]).as_list(), tf.as_dtype(entry[1]).name]
            for entry in signature]


def check_sets(meta: dict, variables: Sequence, gradient_flow) -> None:
    """Checks every saved variable set against the optimizer's `variables` (in its order) and
    the pack plan `gradient_flow` would build for them. Sets saved without a signature pass.

    Raises:
      CheckpointMismatchError naming the variables, or the settings, that differ.
    """
    for saved in meta["sets"]:
        signature = saved.get("signature")
        if signature is None:
            continue
        positions = saved["variables"]
        here = [variables[p] for p in positions if p < len(variables)]
        fits = len(here) == len(positions) and all(
            entry is None or (list(v.shape) == entry[0] and tf.as_dtype(v.dtype).name == entry[1])
            for v, entry in zip(here, signature))
        shapes = [None if entry is None else tuple(entry[0]) for entry in signature]
        check(fits, f"it holds the state of [{saved['name']}] (optimizer positions {positions}, "
                    f"shapes {shapes}), but this optimizer's trainable variables are "
                    f"[{describe(variables)}] (shapes {[tuple(v.shape) for v in variables]}). "
                    f"Restore into the same model with the same trainable variables, or start "
                    f"without the checkpoint's optimizer state")
        _, _, plan = gradient_flow.pack_plan(
            [None if e is None else (tf.TensorShape(e[0]), tf.as_dtype(e[1])) for e in signature])
        packs = pack_keys(plan)
        now = settings_of(gradient_flow)
        then = meta.get("settings", now)
        differ = ", ".join(f"{k} {then[k]!r} then, {now[k]!r} now" for k in now if then.get(k) != now[k])
        check(saved["packs"] == packs,
              f"it was saved with other GradientFlowAllReduce settings ({differ or 'another model'}): "
              f"its pack plan {saved['packs']} differs from this run's {packs}. Use the same settings")


def another_set_message(saved_sets: Sequence[dict], set_name: str, positions) -> str:
    """The first-step mismatch of a checkpoint without signatures: no saved set has these variables."""
    saved = "; ".join(f"[{x['name']}] (optimizer positions {x['variables']})" for x in saved_sets)
    return (f"gf_tf: cannot restore the reducer state: the checkpoint holds it for {saved}, but this "
            f"step all-reduces [{set_name}] (optimizer positions {positions}). Restore into the "
            f"same model with the same trainable variables, or start without the checkpoint's "
            f"optimizer state.")


def put_gf_tf_first(original):
    """Wraps Keras's `saving_lib._raise_loading_failure(error_msgs, warn_only=False)`: when a
    gf_tf CheckpointMismatchError is among the collected errors, the CheckpointMismatchError
    raised has gf_tf's message, then the objects Keras could not load (and their errors)."""
    def raise_loading_failure(error_msgs, warn_only=False, *args, **kwargs):
        failures = list(error_msgs.values())
        ours = [error for _, error in failures if isinstance(error, CheckpointMismatchError)]
        if not ours or warn_only:
            return original(error_msgs, warn_only, *args, **kwargs)
        others = "".join(f"\n- {saveable}: {error}" for saveable, error in failures
                         if error is not ours[0])
        raise CheckpointMismatchError(
            f"{ours[0]}\n\n(Keras: {len(failures)} object(s) could not be loaded: "
            f"{[saveable for saveable, _ in failures]}){others}") from ours[0]
    return raise_loading_failure
