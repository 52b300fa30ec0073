"""No file outside gf_tf/ (tests/, benchmarks/, models/, examples/) calls a private method or
function of gf_tf: what a benchmark, a model or a test of behaviour needs has a public door.

What counts: a call `<anything>._name(...)` where `_name` is private in gf_tf's public modules
(a `def _name`, `class _Name`, module-level `_name =`, or a `self._name` attribute) and is neither
TensorFlow's or Keras's (a private name of a class gf_tf subclasses, such as tf.Module's
`_restore_from_tensors`; `strategy.extended._cross_device_ops`) nor an attribute or method the
calling file defines on its own objects. Modules whose own name is private (gf_tf/ops/_library.py,
_build.py) are the op library's loader and build, tested white-box by name; they are not counted.
"""

import importlib
import inspect
import io
import os
import pkgutil
import re
import tokenize
import warnings

import gf_tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = ("tests", "benchmarks", "models", "examples")
TENSORFLOW_NAMES = {"_cross_device_ops"}   # strategy.extended's: where gf_tf installs itself
_DEFINED = [re.compile(p, re.M) for p in (r"self\.(_[A-Za-z]\w*)", r"^\s*def (_[A-Za-z]\w*)",
                                          r"^\s*class (_[A-Za-z]\w*)", r"^(_[A-Za-z]\w*)\s*[:=]")]
# What a file's own objects may hold: its attributes and methods (not its module-level names).
_OWN = [re.compile(p, re.M) for p in (r"self\.(_[A-Za-z]\w*)", r"^\s+def (_[A-Za-z]\w*)")]


def _python_files(*dirs):
    for top in dirs:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def _defined(path, patterns=_DEFINED):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return {name for pattern in patterns for name in pattern.findall(text)}


def _inherited_from_outside():
    """Private names of the TensorFlow / Keras classes that gf_tf's classes subclass."""
    names = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for info in pkgutil.walk_packages(gf_tf.__path__, "gf_tf."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                for base in cls.__mro__:
                    if not base.__module__.startswith("gf_tf"):
                        names |= {n for n in dir(base) if n.startswith("_")}
    return names


def _gf_tf_private_names():
    public_modules = [p for p in _python_files("gf_tf")
                      if not os.path.basename(p).startswith("_") or p.endswith("__init__.py")]
    names = set().union(*(_defined(p) for p in public_modules))
    return names - _inherited_from_outside() - TENSORFLOW_NAMES


def private_calls(path, private):
    """[(line, name)]: calls `._name(` in `path`'s code (not its strings or comments)."""
    with open(path, encoding="utf-8") as f:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(f.read()).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    own = _defined(path, _OWN)
    return [(tokens[i].start[0], tokens[i].string) for i in range(1, len(tokens) - 1)
            if tokens[i - 1].string == "." and tokens[i].string in private - own
            and tokens[i + 1].string == "("]


def test_no_file_outside_gf_tf_calls_a_private_name_of_gf_tf():
    private = _gf_tf_private_names()
    found = [f"{os.path.relpath(path, ROOT)}:{line}: .{name}("
             for path in _python_files(*OUTSIDE) for line, name in private_calls(path, private)]
    assert not found, "calls of gf_tf's private names (give them a public door):\n" + \
        "\n".join(found)


def test_the_check_sees_a_private_method_called_from_outside(tmp_path):
    """A call of a private method such as `gradient_flow._run(...)` (the route with identity
    collectives, whose public door is `reduce_locally`) is caught; the same text in a string or a
    comment is not."""
    path = tmp_path / "worker.py"
    path.write_text("ops = gradient_flow._cross_ops()  # gradient_flow._orchestrator(None)\n"
                    "text = 'gradient_flow._orchestrator(None)'\n")
    assert private_calls(str(path), _gf_tf_private_names()) == [(1, "_cross_ops")]
