"""README.md and docs/: every Python example runs (or says why not), the pages tell no story, the version is
one number, and README stays short."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# Reports and the changelog record history by design; the reference pages do not.
_HISTORY_EXEMPT = (DOCS / "reports", DOCS / "changelog.md")

_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")
_FENCE = re.compile(r"^```python\s*$")

_HISTORY = re.compile(
    r"\b(?:was|were|former(?:ly)?|(?<!nox )sessions?|stops? \d+|commits?|here|today|no longer|now|issue #?\d+)\b"
    r"|\b(?=[0-9a-f]{7,40}\b)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]+\b",
    re.IGNORECASE)


def _pages():
    pages = [REPO / "README.md"]
    for path in sorted(DOCS.rglob("*.md")):
        if not any(path == exempt or exempt in path.parents for exempt in _HISTORY_EXEMPT):
            pages.append(path)
    return pages


def _python_blocks(path):
    """(line number, code, not-run reason or None) of each ```python fence of a Markdown file."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            reason = _NOT_RUN.search(lines[start - 2]) if start >= 2 else None
            blocks.append((start, "\n".join(body) + "\n", reason.group(1).strip() if reason else None))
        i += 1
    return blocks


def _all_blocks():
    return [pytest.param(path, line, code, reason, id=f"{path.relative_to(REPO)}:{line}")
            for path in _pages() for line, code, reason in _python_blocks(path)]


# Names a page's example may use without defining them: the reader's own model and data.
_STAND_INS = {
    "build_model": '''
def build_model():
    import keras
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
''',
    "dataset": '''
import numpy as _np, tensorflow as _tf
_rng = _np.random.default_rng()
dataset = _tf.data.Dataset.from_tensor_slices(
    (_rng.standard_normal((64, 8)).astype("float32"), _rng.integers(0, 3, 64))).batch(16)
''',
}


def with_stand_ins(code):
    """The block with a definition of each stand-in it uses but does not define, inserted just before the
    first top-level statement that uses it (so a strategy created first still comes before any TF op)."""
    tree = ast.parse(code)
    defined = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    defined |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    lines = code.splitlines(keepends=True)
    inserts = {}
    for name, definition in _STAND_INS.items():
        if name in defined:
            continue
        for statement in tree.body:
            if any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(statement)):
                inserts.setdefault(statement.lineno - 1, []).append(definition)
                break
    out = []
    for index, line in enumerate(lines):
        out.extend(inserts.get(index, []))
        out.append(line)
    return "".join(out)


@pytest.mark.slow  # each example starts a fresh TensorFlow
@pytest.mark.parametrize("path,line,code,reason", _all_blocks())
def test_every_python_example_runs_or_says_why_not(path, line, code, reason, tmp_path):
    if reason is not None:
        assert len(reason) >= 10, f"{path.name}:{line}: a not-run reason says why, e.g. 'needs 2 workers'"
        return
    pytest.importorskip("tensorflow")
    script = tmp_path / "example.py"
    script.write_text(with_stand_ins(code))
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=str(REPO), env=env, check=False)
    assert out.returncode == 0, f"{path.name}:{line} failed:\n{out.stderr[-3000:]}"


def test_the_stand_ins_go_before_the_first_statement_that_uses_them():
    code = "import gf_tf\nstrategy = gf_tf.MultiWorkerMirroredStrategy()\nwith strategy.scope():\n    m = build_model()\nm.fit(dataset)\n"
    out = with_stand_ins(code)
    assert out.index("MultiWorkerMirroredStrategy()") < out.index("def build_model") < out.index("with strategy")
    assert out.index("m = build_model()") < out.index("dataset = _tf.data") < out.index("m.fit(dataset)")
    own = "def build_model():\n    return 1\nbuild_model()\n"
    assert with_stand_ins(own) == own


def test_the_docs_have_python_examples_and_each_is_parsed():
    blocks = _all_blocks()
    assert len(blocks) >= 5
    for param in blocks:
        path, line, code, _ = param.values
        compile(code, f"{path.name}:{line}", "exec")


def test_readme_and_the_reference_pages_tell_no_story():
    hits = []
    for path in _pages():
        in_fence = False
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if text.startswith("```"):
                in_fence = not in_fence
            # Link targets (report file names carry dates and topics) are not prose.
            match = None if in_fence else _HISTORY.search(re.sub(r"\]\([^)]*\)", "]", text))
            if match:
                hits.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {text.strip()[:100]}")
    assert not hits, "history words in README/docs (reports and the changelog may have them):\n" + "\n".join(hits)


def test_the_history_pattern_catches_what_it_should_and_spares_the_rest():
    for text in ("the default was 0.001", "stop 24's CI", "commit 54dd3c4", "measured here", "Stop 23 added",
                 "formerly known", "in this session", "an earlier session's", "fixed in issue #12", "is now the default"):
        assert _HISTORY.search(text), text
    for text in ("a chunk of 1024 elements", "where each pack", "the deadbeef check", "sha 1234567",
                 "knowhere", "stop the workers", "nowhere", "a nox session"):
        assert not _HISTORY.search(text), text


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; reference material belongs in docs/"


def test_the_package_the_changelog_and_gf_tf_share_one_version():
    pyproject = (REPO / "pyproject.toml").read_text()
    init = (REPO / "gf_tf" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"$', init, flags=re.M).group(1)
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "gf_tf.__version__"}' in pyproject
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d\d-\d\d)$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0][0] == version, (releases, version)


def test_every_docs_page_is_in_the_site_navigation():
    nav = (REPO / "mkdocs.yml").read_text()
    for path in sorted(DOCS.glob("*.md")) + sorted((DOCS / "api").glob("*.md")):
        assert str(path.relative_to(DOCS)) in nav, f"{path} is not in mkdocs.yml's nav"


def test_every_option_in_readmes_table_exists_with_the_default_shown():
    import inspect   # pylint: disable=import-outside-toplevel
    import gf_tf   # pylint: disable=import-outside-toplevel
    text = (REPO / "README.md").read_text()
    table = text.split("<!-- --8<-- [start:options] -->", 1)[1].split("<!-- --8<-- [end:options] -->", 1)[0]
    rows = re.findall(r"^\| `(\w+)\((\w+)=\)` \| `([^`]*)` \|", table, flags=re.M)
    assert len(rows) == table.count("\n| `"), "a row of the options table is not of the form | `Class(arg=)` | `default` |"
    shown = {(cls, arg) for cls, arg, _ in rows}
    for cls in ("GradientFlowAllReduce", "ChunkSparsity"):
        parameters = inspect.signature(getattr(gf_tf, cls).__init__).parameters
        assert {arg for c, arg in shown if c == cls} == set(parameters) - {"self"}, cls
    for cls, arg, default in rows:
        actual = inspect.signature(getattr(gf_tf, cls).__init__).parameters[arg].default
        assert ast.literal_eval(default) == actual and type(ast.literal_eval(default)) is type(actual), \
            (cls, arg, default, actual)
