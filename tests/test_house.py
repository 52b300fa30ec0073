"""The house's size rule: no Python file of gf_tf/, benchmarks/ or models/ is longer than 400 lines.

A file that outgrows it holds more than one job: split it along one (as benchmarks/step_model.py beside
benchmarks/projection.py, models/tfrecords.py beside models/datasets.py). The rule has no exception.
"""

import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 400
CHECKED = ("gf_tf", "benchmarks", "models")


def test_no_python_file_of_gf_tf_benchmarks_or_models_is_longer_than_400_lines():
    files = sorted(path for folder in CHECKED for path in (REPO / folder).rglob("*.py"))
    assert {"gf_tf/__init__.py", "benchmarks/harness.py", "models/train.py"} <= {
        str(path.relative_to(REPO)) for path in files}
    too_long = {str(path.relative_to(REPO)): n for path in files
                if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"files over {MAX_LINES} lines (split each along one of its jobs): {too_long}"
