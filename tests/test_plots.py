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


def test_convergence_figures_draw_one_png_per_task_and_link(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install '.[plot]')")
    import json
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def run(task, rate, method, n, accuracies):
        return {"task": task, "rate_mbit": rate, "method": method, "workers": n,
                "curve": [{"seconds": 2.0 * (i + 1), "bytes_sent": 1e5 * (i + 1), "test_accuracy": a}
                          for i, a in enumerate(accuracies)]}

    path = tmp_path / "convergence.json"
    path.write_text(json.dumps({"meta": {"date_utc": "test input"}, "runs": [
        run("mnist1d", 100.0, "tf_fp32", 2, [0.5, 0.8]), run("mnist1d", 100.0, "csc_1", 4, [0.4, 0.7]),
        run("mnist1d", None, "tf_fp16", 2, [0.5, 0.8]), run("digits", None, "default", 2, [0.9, 0.95]),
        {"task": "digits", "rate_mbit": None, "method": "csc_1", "workers": 2, "error": "exit 1"}]}))
    written = plots.convergence_figures([str(path)], str(tmp_path / "img"), plt)
    plt.close("all")
    assert sorted(os.path.basename(p) for p in written) == [
        "convergence-digits-unshaped.png", "convergence-mnist1d-100mbit.png", "convergence-mnist1d-unshaped.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", p
