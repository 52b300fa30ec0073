"""The import graph of gf_tf/: no circle, the core imports neither Keras nor the layers above it, and
no import goes up a row of docs/architecture.md's layer table.

Read from the source (every `import` statement, at module level or inside a function), so a lazy
import that closes a circle counts as one.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gf_tf"

# Above the core: the package face, the strategy, the launcher.
ABOVE_CORE = {"gf_tf", "gf_tf.strategy", "gf_tf.launch"}
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


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _layers():
    """{module name: its row in docs/architecture.md's layer table (0 = the top)} from the page."""
    rows = []
    in_table = False
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("| layer |"):
            in_table = True
        elif in_table and not line.startswith("|"):
            break
        elif in_table and not line.startswith("| ---"):
            rows.append(line.split("|")[2])
    assert rows, "docs/architecture.md has no layer table"
    layer = {}
    for row, cell in enumerate(rows):
        for path in cell.replace("`", "").split(","):
            layer[_module_name(PACKAGE / path.strip())] = row
    return layer


def _layer_of(name, layer):
    """A module's row; a package's __init__ (gf_tf.csc) has the row of its modules."""
    if name in layer:
        return layer[name]
    rows = {row for module, row in layer.items() if module.startswith(name + ".")}
    return rows.pop() if len(rows) == 1 else None


def test_every_module_of_gf_tf_has_a_row_in_the_architecture_pages_layer_table():
    modules, _ = _graph()
    layer = _layers()
    assert not [name for name in modules if _layer_of(name, layer) is None]
    assert not [name for name in layer if name not in modules]


def test_imports_go_from_a_row_of_the_architecture_page_to_its_own_row_or_below():
    """The rule docs/architecture.md states, read from its table: an import never goes up a row."""
    modules, edges = _graph()
    layer = _layers()
    upward = sorted(f"{name} -> {other}" for name in modules for other in edges[name]
                    if other in modules and _layer_of(other, layer) < _layer_of(name, layer))
    assert not upward, upward
