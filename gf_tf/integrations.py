"""Framework integrations (the Keras wing) that the core runs without importing them.

`GradientFlowAllReduce` and `gf_tf.MultiWorkerMirroredStrategy` call
`install_all()` when they are created, so every registered installer has run
before a framework traces a step with them. `gf_tf/__init__.py` registers the
Keras wing's installer, which imports gf_tf.keras (and Keras) only when it runs
and only if a Keras is installed: the core itself never imports Keras.
"""

from typing import Callable, List

_INSTALLERS: List[Callable[[], None]] = []


def register(installer: Callable[[], None]) -> None:
    """Adds `installer` (idempotent, no arguments) to those `install_all` runs, once."""
    if installer not in _INSTALLERS:
        _INSTALLERS.append(installer)


def install_all() -> None:
    """Runs every registered installer, in the order registered (each must be idempotent)."""
    for installer in list(_INSTALLERS):
        installer()
