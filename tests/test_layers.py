"""The import graph of gf_tf/: no circle, and the core imports neither Keras nor the layers above it.

Read from the source (every `import` statement, at module level or inside a function), so a lazy
import that closes a circle counts as one.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gf_tf"

# Above the core: the package face, the strategy, the Keras wing (and its old names), the launcher.
ABOVE_CORE = {"gf_tf", "gf_tf.strategy", "gf_tf.keras_compat", "gf_tf.checkpoint", "gf_tf.launch"}
KERAS_ROOTS = ("keras", "tf_keras")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, ours):
    """Every module name `path` imports: for `from a import b`, a.b where that is one of `ours`, else a."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in ours else node.module)
    return names


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        imported = _imports(path, modules)
        edges[name] = {m for m in imported if m in modules and m != name}
        edges[name] |= {m for m in imported if m.split(".")[0] in KERAS_ROOTS}
    return modules, edges


def _is_core(name: str) -> bool:
    return name not in ABOVE_CORE and not name.startswith("gf_tf.keras")


def test_the_package_has_no_import_circle():
    modules, edges = _graph()
    state = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(edges.get(name, ())):
            if other not in modules:
                continue
            if state.get(other) == "open":
                pytest.fail("import circle: " + " -> ".join(path + [other]))
            if other not in state:
                visit(other, path + [other])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])


def test_the_core_imports_no_keras_and_nothing_above_it():
    modules, edges = _graph()
    core = sorted(name for name in modules if _is_core(name))
    assert "gf_tf.cross_device_ops" in core and "gf_tf.csc.reducer" in core and "gf_tf.ops" in core
    offending = {name: sorted(m for m in edges[name]
                              if m.split(".")[0] in KERAS_ROOTS or not _is_core(m))
                 for name in core}
    assert not {k: v for k, v in offending.items() if v}, offending
