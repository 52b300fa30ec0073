"""Integrations (the Keras wing) that the core runs and names without importing them.

The core (GradientFlowAllReduce) calls `install_all()` when it is created, so
every registered installer has run before a framework traces a step with it.
A core module whose public name moved into a wing answers it with `lent(...)`.
`gf_tf/__init__.py` registers the Keras wing here, importing gf_tf.keras only
when an installer or a lent name is used: the core itself never imports Keras.
"""

from typing import Callable, Dict, List, Tuple

_INSTALLERS: List[Callable[[], None]] = []
_LENT: Dict[Tuple[str, str], Callable[[], object]] = {}


def register(installer: Callable[[], None]) -> None:
    """Adds `installer` (idempotent, no arguments) to those `install_all` runs, once."""
    if installer not in _INSTALLERS:
        _INSTALLERS.append(installer)


def install_all() -> None:
    """Runs every registered installer, in the order registered (each must be idempotent)."""
    for installer in list(_INSTALLERS):
        installer()


def lend(module: str, name: str, load: Callable[[], object]) -> None:
    """Makes `module`.`name` (a core module's former name) be `load()`, loaded when first asked for."""
    _LENT[(module, name)] = load


def lent(module: str, name: str):
    """The value lent as `module`.`name`; AttributeError (a module `__getattr__`'s) if none is."""
    if (module, name) not in _LENT:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return _LENT[(module, name)]()
