"""gf_tf's docstrings and comments say what the code does: no lab notes (dates, "measured here",
"stop N", sessions, issue numbers, commit hashes, timings in milliseconds). Measurements live in
benchmarks/results/ and docs/benchmarks.md; a docstring that needs one points there."""

import ast
import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gf_tf"

LAB_NOTES = re.compile(
    r"\bmeasured here\b"
    r"|\bstops? \d+"
    r"|(?<!nox )\bsessions?\b"
    r"|\bissue #?\d+"
    r"|\b20\d\d-\d\d-\d\d\b"
    r"|\bcommits? [0-9a-f]{7,40}\b"
    r"|\b(?:today|yesterday|last week)\b"
    r"|\b\d+(?:\.\d+)? ?(?:ms|us|µs)\b",
    re.IGNORECASE)


def prose(path):
    """(line, text) of every line of `path`'s comments and string statements (docstrings, attribute
    docstrings); code and the strings it computes with (messages, f-strings) are not prose."""
    source = path.read_text()
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for offset, text in enumerate(node.value.value.splitlines()):
                lines.append((node.lineno + offset, text))
    return lines


def lab_notes(paths, root=PACKAGE.parent):
    """"file:line: 'hit' in text" for every lab-note pattern in the prose of `paths` (file names
    relative to `root`), in file and line order."""
    hits = []
    for path in paths:
        for line, text in sorted(prose(path)):
            match = LAB_NOTES.search(text)
            if match:
                hits.append(f"{path.relative_to(root)}:{line}: {match.group(0)!r} in {text.strip()[:100]}")
    return hits


def test_gf_tf_docstrings_and_comments_hold_no_lab_notes():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 20
    hits = lab_notes(paths)
    assert not hits, ("lab notes in gf_tf's docstrings or comments (say what the code does; "
                      "figures go to docs/benchmarks.md):\n" + "\n".join(hits))


def test_the_patterns_catch_lab_notes_and_spare_the_code_words(tmp_path):
    for text in ("measured here", "at stop 24", "Stop 23 added it", "in this session",
                 "fixed in issue #12", "on 2025-11-03", "commit 54dd3c4", "1.45 ms per hop",
                 "as of today"):
        assert LAB_NOTES.search(text), text
    for text in ("stop the workers", "start_new_session=True", "a nox session", "keras#20585",
                 "(#2)", "after 10 s", "2**4 = 16x", "a1b2c3d4_p0_float32_n1024", "timestamps"):
        assert not LAB_NOTES.search(text), text
    module = tmp_path / "module.py"
    module.write_text('"""Module.\n\nFast (measured here)."""\n\nX = f"2025-01-01"  # stop 3\n'
                      'MESSAGE = "an issue 7 in a message is code"\n')
    hits = [hit.split(": ", 1)[0] for hit in lab_notes([module], root=tmp_path)]
    assert hits == ["module.py:3", "module.py:5"], hits
