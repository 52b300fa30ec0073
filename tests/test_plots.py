"""benchmarks.plots draws the three figures of docs/benchmarks.md from the JSON committed in benchmarks/results/."""

import os
import re

import pytest

from benchmarks import plots


def test_the_plot_script_draws_every_figure_from_the_committed_json(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install '.[plot]'); "
                                             "benchmarks.plots needs it")
    for path in [*plots.DEFAULT_SPEED, *plots.DEFAULT_BYTES, *plots.DEFAULT_PROJECTION]:
        assert os.path.exists(path), f"{path} is missing: docs/benchmarks.md's figures read it"
    assert plots.main(["--out-dir", str(tmp_path)]) == 0
    for name in plots.FIGURES:
        png = tmp_path / name
        assert png.exists() and png.stat().st_size > 10_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_a_transcribed_json_names_its_report_and_date():
    for path in [*plots.DEFAULT_SPEED, *plots.DEFAULT_BYTES]:
        meta = plots.load(path)["meta"]
        if meta.get("transcribed"):
            report = re.search(r"benchmarks/results/\d{4}-\d\d-\d\d-[\w.-]+\.md", meta["source"])
            assert report and meta["measured"], path
            assert os.path.exists(os.path.join(plots.REPO_ROOT, report.group(0))), report.group(0)
