"""CSC's registries: the selection policies by name, and the density rules.

`ChunkSparsity(selection=name)` takes its policy from `POLICIES` (`policy`), and
`ChunkSparsity(density=...)` its rule from `density_rule`. A selection policy of your own is
one module holding a `gf_tf.csc.selection.SelectionPolicy` subclass plus one `register`
call (docs/csc.md, "Adding a selection policy"). Every worker must register the same
policies: the settings handshake compares the `selection=` name.
"""

from typing import Dict, Sequence, Union

from gf_tf.csc.ahead import AheadSelection
from gf_tf.csc.auto import AUTO, AutoDensity
from gf_tf.csc.density import DensityRule, FixedDensity
from gf_tf.csc.global_top_k import GlobalSelection
from gf_tf.csc.per_pack import PerPackSelection
from gf_tf.csc.selection import SelectionPolicy

POLICIES: Dict[str, SelectionPolicy] = {}
"""The registered selection policies by `selection=` name (the built-in ones first)."""
BUILT_IN = ("per_pack", "global", "ahead")


def register(policy: SelectionPolicy) -> None:
    """Adds `policy` under `policy.name`.

    Raises:
      ValueError: the name is empty or already registered.
    """
    if not policy.name or policy.name in POLICIES:
        raise ValueError(f"a selection policy needs a new name; got {policy.name!r} "
                         f"(registered: {tuple(POLICIES)})")
    POLICIES[policy.name] = policy


def unregister(name: str) -> None:
    """Removes the policy registered under `name`.

    Raises:
      ValueError: `name` is built in or not registered.
    """
    if name in BUILT_IN or name not in POLICIES:
        raise ValueError(f"cannot unregister selection policy {name!r}: only registered "
                         f"ones that are not built in {BUILT_IN} can go")
    del POLICIES[name]


for _policy in (PerPackSelection(), GlobalSelection(), AheadSelection()):
    register(_policy)


def policy(name: str) -> SelectionPolicy:
    """The policy registered as `name`.

    Raises:
      ValueError: no policy has that name (the message lists the registered ones).
    """
    if name not in POLICIES:
        raise ValueError(f"selection must be one of {tuple(POLICIES)} (the policies registered "
                         f"in gf_tf.csc.policies), got {name!r}")
    return POLICIES[name]


def density_rule(density: Union[float, str, DensityRule], **auto_settings) -> DensityRule:
    """The rule of `ChunkSparsity(density=...)`: a `DensityRule` as it is, `AutoDensity` for
    "auto" (with `auto_settings`: min_density, budget), else `FixedDensity`; each rule checks
    its own arguments (`auto_settings` are checked beside a fraction too, where they go unused,
    so a wrong one never passes silently).

    Raises:
      ValueError: another string than "auto", or the rule's own ValueError.
    """
    if isinstance(density, DensityRule):
        return density
    if isinstance(density, str):
        if density != AUTO:
            raise ValueError(f"density must be a fraction in (0, 1] or \"auto\", got {density!r}")
        return AutoDensity(**auto_settings)
    AutoDensity(**auto_settings)
    return FixedDensity(density)


def check(selection: SelectionPolicy, rule: DensityRule, scoring: str, default_scoring: str):
    """Raises ValueError when the policy, the density rule and `scoring` do not go together:
    a rule that times each step with a policy whose sparse steps carry no control
    all-reduce, or a scoring other than the default with a policy that takes none."""
    name = selection.name
    if rule.measures and not selection.carries_control:
        carriers = [p.name for p in POLICIES.values() if p.carries_control]
        raise ValueError(f"selection=\"{name}\" needs a numeric density: density=\"auto\" decides "
                         f"each step from that step's timing, which only selection={_quoted(carriers)} "
                         f"carry (density=\"auto\" is the default); use one of those with "
                         f"density=\"auto\", or a fixed density with \"{name}\", e.g. "
                         f"ChunkSparsity(density=0.01, selection=\"{name}\")")
    if scoring != default_scoring and scoring not in selection.scorings:
        takers = _quoted([p.name for p in POLICIES.values() if scoring in p.scorings])
        raise ValueError(f"scoring={scoring!r} scores chunks for the next step, which only "
                         f"selection={takers} does; got selection={name!r}. Pass "
                         f"selection={takers}, or leave scoring at its default")


def _quoted(names: Sequence[str]) -> str:
    """'"a" or "b"'."""
    return " or ".join(f'"{name}"' for name in names)
