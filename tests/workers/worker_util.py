"""Worker-side half of tests/cluster.py: options from the environment, writing the result."""

import json
import os

import numpy as np


def comm_timeout() -> float:
    """Seconds for CommunicationOptions(timeout_seconds=...), set by tests/cluster.py."""
    return float(os.environ.get("GF_TF_COMM_TIMEOUT", "30"))


def task_index() -> int:
    return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def communication_options():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.distribute.experimental.CommunicationOptions(timeout_seconds=comm_timeout())


def regression_data(num_examples: int):
    """Seeded (x float32 [n, 8], y float32 [n, 3]): a noisy linear map, the same on every worker."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3)) + 0.1 * rng.normal(size=(num_examples, 3))).astype(np.float32)
    return x, y


def write_result(**arrays) -> None:
    """Saves named arrays where tests/cluster.py reads them (GF_TF_RESULT)."""
    np.savez(os.environ["GF_TF_RESULT"], **{k: np.asarray(v) for k, v in arrays.items()})


def collective_reduces(model):
    """(dtype name, element count) of every CollectiveReduceV2 in the model's traced train step.

    Reads the concrete functions behind `model.train_function` and the branch
    graphs of their conds (test-only use of tf.function's
    `_list_all_concrete_functions` and cond_v2's `If._true_graph/_false_graph`).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    found, seen = [], set()

    def scan(graph):
        for op in graph.get_operations():
            if op.type == "CollectiveReduceV2":
                found.append((op.get_attr("T").name, op.inputs[0].shape.num_elements()))
            for branch in ("_true_graph", "_false_graph"):
                if getattr(op, branch, None) is not None:
                    scan(getattr(op, branch))

    def walk(obj):
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                c = cell.cell_contents
            except ValueError:
                continue
            if id(c) in seen:
                continue
            seen.add(id(c))
            if isinstance(c, tf.types.experimental.PolymorphicFunction):
                for concrete in c._list_all_concrete_functions():  # pylint: disable=protected-access
                    scan(concrete.graph)
            if callable(c):
                walk(c)

    walk(model.train_function)
    return found
