"""benchmarks.convergence: time to target on synthetic curves, the per-cell summary, the matrix and
its dry run, every method's models.train flags, and one real 2-worker cell (slow)."""

import copy
import json
import os
import tempfile

import pytest

from benchmarks import convergence
from models import factory, train


def _curve(points):
    return [{"epoch": i + 1, "seconds": s, "bytes_sent": 100.0 * (i + 1), "test_accuracy": a}
            for i, (s, a) in enumerate(points)]


def test_time_to_target_is_the_first_point_at_or_above_the_target():
    curve = _curve([(2.0, 0.50), (4.0, 0.79), (6.0, 0.80), (8.0, 0.78), (10.0, 0.85)])
    assert convergence.time_to_target(curve, 0.80) == 6.0      # reached exactly, not interpolated
    assert convergence.time_to_target(curve, 0.81) == 10.0     # the dip at 8 s does not count
    assert convergence.time_to_target(curve, 0.40) == 2.0
    assert convergence.time_to_target(curve, 0.86) is None     # not reached
    assert convergence.time_to_target(_curve([(1.0, None), (2.0, 0.9)]), 0.5) == 2.0


@pytest.mark.parametrize("times, expected", [
    ([10.0, None, 30.0], 30.0),          # "not reached" sorts last
    ([10.0, None, None], None),          # fewer than half reached it
    ([10.0, 20.0], 15.0),
    ([None, 20.0], None),
    ([], None),
])
def test_median_time_to_target_counts_not_reached_as_latest(times, expected):
    assert convergence.median_time_to_target(times) == expected


def _run(method, seed, final, curve_points, task="mnist1d", n=2, rate=100.0, bytes_per_step=1000.0, load=1.5):
    return {"task": task, "workers": n, "rate_mbit": rate, "method": method, "seed": seed, "final_accuracy": final,
            "sent_bytes_per_step": bytes_per_step, "dense_bytes_per_step": 4000.0, "load_average_1min": load,
            "curve": _curve(curve_points)}


def test_summary_sets_the_target_from_tf_fp32_and_reports_each_cell():
    runs = [_run("tf_fp32", s, f, [(10.0, f - 0.2), (20.0, f)]) for s, f in enumerate((0.90, 0.92, 0.91))]
    runs += [_run("csc_1", 0, 0.905, [(3.0, 0.85), (6.0, 0.905)], bytes_per_step=50.0, load=2.5),
             _run("csc_1", 1, 0.895, [(3.0, 0.86), (6.0, 0.895)], bytes_per_step=60.0),
             _run("csc_1", 2, 0.88, [(3.0, 0.87), (6.0, 0.88)], bytes_per_step=70.0),
             {"task": "mnist1d", "workers": 2, "rate_mbit": 100.0, "method": "gf_fp16", "seed": 0,
              "load_average_1min": 1.0, "error": "exit 1"}]
    cells = {c["method"]: c for c in convergence.summarize(runs)}
    assert set(cells) == {"tf_fp32", "csc_1"}   # a failed run is left out
    base, csc = cells["tf_fp32"], cells["csc_1"]
    assert base["final_accuracy_median"] == 0.91 and base["vs_tf_fp32_points"] == 0
    assert csc["target"] == pytest.approx(0.90)
    assert csc["final_accuracy_median"] == 0.895
    assert (csc["final_accuracy_min"], csc["final_accuracy_max"]) == (0.88, 0.905)
    assert csc["vs_tf_fp32_points"] == pytest.approx(-1.5)
    assert csc["times_to_target_s"] == [6.0, None, None] and csc["time_to_target_s"] is None
    assert base["times_to_target_s"] == [20.0, 20.0, 20.0] and base["time_to_target_s"] == 20.0
    assert csc["time_vs_tf_fp32"] is None and base["time_vs_tf_fp32"] == 1.0
    assert csc["bytes_per_step"] == 60.0 and csc["load_average_1min"] == [1.5, 2.5]
    text = convergence.tables(list(cells.values()))
    assert "mnist1d, N=2, 100 Mbit/s: target 90.00%" in text and "load average 1.5-2.5" in text
    assert "not reached" in text and "20.0 s" in text and "-1.50" in text and "1.00x" in text


@pytest.mark.parametrize("times, base, expected", [
    ({0: 5.0, 1: 12.0, 2: 9.0}, {0: 10.0, 1: 10.0, 2: 10.0}, 0.9),   # per seed 0.5, 1.2, 0.9
    ({0: 9.0, 1: 11.0, 2: 8.0}, {0: 11.0, 1: 10.0, 2: 8.0}, 1.0),    # paired, not median over median (9/10)
    ({0: 5.0, 1: None, 2: 6.0}, {0: 10.0, 1: 10.0, 2: 10.0}, 0.6),    # "not reached" sorts last
    ({0: 5.0, 1: None, 2: None}, {0: 10.0, 1: 10.0, 2: 10.0}, None),
    ({0: 5.0, 1: 4.0}, {0: 10.0, 1: None}, 0.5),                       # tf_fp32 did not reach it: seed left out
    ({0: 5.0}, {1: 10.0}, None),                                       # no seed pairs
])
def test_paired_time_ratio_is_the_median_of_per_seed_ratios(times, base, expected):
    ratio = convergence.paired_time_ratio(times, base)
    assert ratio == (None if expected is None else pytest.approx(expected))


def test_merge_summarizes_earlier_outputs_and_a_later_run_replaces_an_earlier_one(tmp_path, capsys):
    meta = {"command": "c", "date_utc": "d", "git_commit": "g", "wall_seconds": 60.0,
            "load_average_at_start": [1.0, 1.0, 1.0], "load_average_at_end": [2.0, 2.0, 2.0]}
    first = {"meta": meta, "runs": [_run("tf_fp32", 0, 0.90, [(1.0, 0.90)]),
                                    _run("csc_1", 0, 0.50, [(1.0, 0.50)])]}
    second = {"meta": {**meta, "wall_seconds": 30.0}, "runs": [_run("csc_1", 0, 0.895, [(0.5, 0.895)])]}
    paths = []
    for i, payload in enumerate((first, second)):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(payload, f)
    out = tmp_path / "all.json"
    assert convergence.main(["--merge", *paths, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert sorted((r["method"], r["final_accuracy"]) for r in merged["runs"]) == [("csc_1", 0.895), ("tf_fp32", 0.90)]
    csc = next(c for c in merged["cells"] if c["method"] == "csc_1")
    assert csc["time_to_target_s"] == 0.5 and csc["vs_tf_fp32_points"] == pytest.approx(-0.5)
    assert merged["meta"]["wall_seconds"] == 90.0 and len(merged["meta"]["merged"]) == 2
    printed = capsys.readouterr().out
    assert "csc_1" in printed and "0.5 s" in printed


def test_the_matrix_is_every_combination_with_tf_fp32_first_in_each_group():
    runs = convergence.matrix(["digits", "mnist1d"], ["csc_1", "tf_fp32"], [0, 1], [2, 4], [100.0, None])
    assert len(runs) == 2 * 2 * 2 * 2 * 2 == len(set(runs))
    assert runs[0] == ("digits", 2, 100.0, "tf_fp32", 0) and runs[1] == ("digits", 2, 100.0, "csc_1", 0)
    full = convergence.preset("full", root=True)
    assert set(full["methods"]) == {"tf_fp32", "tf_fp16", "gf_fp16", "default", "csc_1", "csc_1_ahead", "csc_auto"}
    assert len(convergence.matrix(**full)) == 3 * 7 * 3 * 2 * 2
    quick = convergence.matrix(**convergence.preset("quick", root=True))
    assert [(r[0], r[1], r[2], r[4]) for r in quick] == [("mnist1d_wide", 2, 100.0, 0)] * 2
    assert convergence.preset("quick", root=False)["links"] == [None]


def test_the_estimate_grows_with_the_link_time_of_the_bytes_sent():
    fast = convergence.estimate_run_seconds(("mnist1d_wide", 2, None, "tf_fp32", 0))
    slow = convergence.estimate_run_seconds(("mnist1d_wide", 2, 100.0, "tf_fp32", 0))
    steps = convergence.EPOCHS * convergence.TASKS["mnist1d_wide"].steps_per_epoch
    link = 4.0 * convergence.TASKS["mnist1d_wide"].params * 8 / (100 * 0.95e6)   # 2(N-1)/N = 1 at N = 2
    assert slow - fast == pytest.approx(steps * link)


def test_dry_run_prints_the_matrix_and_its_estimate_and_runs_nothing(capsys):
    assert convergence.main(["--dry-run", "--tasks", "digits,mnist1d", "--methods", "tf_fp32,default",
                             "--seeds", "0", "--workers", "2", "--links", "100,none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tasks ['digits', 'mnist1d'] x methods ['tf_fp32', 'default'] x seeds [0] x N [2] "
                             "x links ['100 Mbit/s', 'unshaped']: 8 runs, estimated ")
    assert len(out) == 1 + 8 and all(line.rstrip().endswith(" s") for line in out[1:])


def _gradient_flow_of(method):
    flag_values = copy.deepcopy(train.FLAGS)
    flag_values(["models.train", *convergence.METHODS[method]])
    f = flag_values
    return factory.build_gradient_flow(f.compression, f.bytes_per_pack, f.density, f.chunk_size, f.warmup_steps,
                                       f.momentum, f.selection, algorithm=f.algorithm, overlap=f.overlap,
                                       scoring=f.scoring, reducer=f.reducer, rank=f.rank), f.tf_all_reduce_dtype


def test_every_method_is_the_reducer_its_name_says():
    import gf_tf
    assert _gradient_flow_of("tf_fp32") == (None, "float32")
    assert _gradient_flow_of("tf_fp16") == (None, "float16")
    default, _ = _gradient_flow_of("default")
    plain = gf_tf.GradientFlowAllReduce()
    assert (default.compression, default.bytes_per_pack, default.algorithm, default.overlap, default.sparsity) \
        == (plain.compression, plain.bytes_per_pack, plain.algorithm, plain.overlap, None)
    fp16, _ = _gradient_flow_of("gf_fp16")
    assert fp16.compression.name == "fp16" and fp16.sparsity is None
    for method, density, selection in [("csc_1", 0.01, "per_pack"), ("csc_1_ahead", 0.01, "ahead"),
                                       ("csc_auto", "auto", "per_pack")]:
        csc, _ = _gradient_flow_of(method)
        assert (csc.sparsity.density, csc.sparsity.selection) == (density, selection), method
    for rank in (1, 2, 4):
        lowrank, _ = _gradient_flow_of(f"lowrank_{rank}")
        assert isinstance(lowrank.reducer, gf_tf.reducers.LowRank) and lowrank.reducer.rank == rank
        assert lowrank.sparsity is None


@pytest.mark.slow
def test_a_tiny_two_worker_cell_records_a_curve_and_the_bytes():
    """digits, 2 workers over loopback (unshaped), tf_fp32, tf_fp16 and csc_1, 2 epochs of 4 steps each."""
    digits_params = sum(int(w.shape.num_elements()) for w in
                        factory.build_model("digits_cnn", (8, 8, 1), 10).trainable_weights)
    extra = ["--epochs", "2", "--steps_per_epoch", "4", "--warmup_steps", "2"]
    with tempfile.TemporaryDirectory() as workdir:
        runs = [convergence.run_local(("digits", 2, None, m, 0), workdir, 600, extra) for m in ("tf_fp32", "tf_fp16", "csc_1")]
    for r in runs:
        assert "error" not in r, r.get("error")
        assert [p["epoch"] for p in r["curve"]] == [1, 2]
        assert 0 < r["curve"][0]["seconds"] < r["curve"][1]["seconds"]
        assert r["curve"][-1]["test_accuracy"] == r["final_accuracy"] and 0 <= r["final_accuracy"] <= 1
    dense, half, csc = runs
    # TensorFlow's all-reduce: 4 bytes per gradient element per step in float32, 2 in float16.
    assert [p["bytes_sent"] for p in dense["curve"]] == [4.0 * digits_params * 4, 4.0 * digits_params * 8]
    assert [p["bytes_sent"] for p in half["curve"]] == [2.0 * digits_params * 4, 2.0 * digits_params * 8]
    # CSC: 2 dense FP16 steps, then 1% of the chunks: less than a quarter of float32 over 8 steps.
    assert csc["curve"][-1]["bytes_sent"] < 0.25 * dense["curve"][-1]["bytes_sent"]
    assert csc["curve"][-1]["bytes_sent"] == pytest.approx(8 * csc["sent_bytes_per_step"])
    cells = {c["method"]: c for c in convergence.summarize(runs)}
    assert cells["csc_1"]["target"] == pytest.approx(dense["final_accuracy"] - 0.01)


def test_the_trainer_and_the_benchmark_use_only_gf_tfs_public_api():
    """No private attribute (`._name`) is read in models/ or the convergence benchmark, except a
    dataclass's own field (Source._make) and os._exit."""
    import re
    allowed = {"self._make", "os._exit"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [os.path.join(root, "models", f) for f in os.listdir(os.path.join(root, "models")) if f.endswith(".py")]
    files += [os.path.join(root, "benchmarks", "convergence.py"), os.path.join(root, "benchmarks", "workers", "train_job.py")]
    hits = []
    for path in files:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                for access in re.findall(r"[\w\])]+\._[a-z]\w*", line):
                    if access not in allowed:
                        hits.append(f"{os.path.relpath(path, root)}:{number}: {access}")
    assert not hits, hits


@pytest.mark.parametrize("task", list(convergence.TASKS))
def test_each_tasks_parameter_count_is_its_models(task):
    name = factory.model_for("", task)
    model = factory.build_model(name, factory.default_input_shape(name), 10)
    assert convergence.TASKS[task].params == sum(int(w.shape.num_elements()) for w in model.trainable_weights)
