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


def test_the_sweep_figure_draws_each_averaging_method_at_its_h_with_medians_over_seeds(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install '.[plot]')")
    import json
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def run(method, seed, accuracies, step_bytes):
        return {"task": "digits", "rate_mbit": 100.0, "method": method, "workers": 2, "seed": seed,
                "final_accuracy": accuracies[-1], "sent_bytes_per_step": step_bytes, "load_average_1min": 1.0,
                "curve": [{"seconds": 2.0 * (i + 1), "bytes_sent": 1e5 * (i + 1), "test_accuracy": a}
                          for i, a in enumerate(accuracies)]}

    runs = [run("tf_fp32", s, [0.5, 0.9], 4000) for s in (0, 1)]
    runs += [run("tf_fp16", 0, [0.6, 0.9], 2000), run("local_8_csc", 0, [0.9, 0.9], 10)]
    runs += [run("local_16", 0, [0.7, 0.88], 120), run("local_16", 1, [0.9, 0.92], 130),
             run("local_4", 0, [0.85, 0.91], 500), run("local_4", 1, [0.9, 0.91], 500)]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"meta": {"date_utc": "test input"}, "runs": runs}))
    out = tmp_path / "sweep.png"
    drawn = plots.sweep_figure([str(path)], str(out), plt)
    plt.close("all")
    # The target is tf_fp32's median final accuracy (0.9) - 1 point: 0.89. local_4 reaches it at 4 s
    # and 2 s (median 3 s); local_16 on one seed of two (median: not reached); local_8_csc is not swept.
    assert drawn == {"digits, N=2, 100 Mbit/s": [(4, pytest.approx(91.0), 3.0, 500),
                                                 (16, pytest.approx(90.0), None, 125)]}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [plots._averaging_every(m) for m in ("local_8", "local_64", "local_8_csc", "diloco_8", "tf_fp16")] == [
        8, 64, None, None, None]
