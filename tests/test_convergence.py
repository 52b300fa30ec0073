"""benchmarks.convergence: time to target on synthetic curves, the per-cell summary, the matrix and
its dry run, every method's models.train flags, and one real 2-worker cell (slow, local SGD)."""

import copy
import json
import math
import tempfile

import pytest

from benchmarks import convergence, convergence_summary
from benchmarks.workers import methods
from gf_tf.wire import ahead_slots
from models import factory, train


def _curve(points):
    return [{"epoch": i + 1, "seconds": s, "bytes_sent": 100.0 * (i + 1), "test_accuracy": a}
            for i, (s, a) in enumerate(points)]


def test_time_to_target_is_the_first_point_at_or_above_the_target():
    curve = _curve([(2.0, 0.50), (4.0, 0.79), (6.0, 0.80), (8.0, 0.78), (10.0, 0.85)])
    assert convergence_summary.time_to_target(curve, 0.80) == 6.0      # reached exactly, not interpolated
    assert convergence_summary.time_to_target(curve, 0.81) == 10.0     # the dip at 8 s does not count
    assert convergence_summary.time_to_target(curve, 0.40) == 2.0
    assert convergence_summary.time_to_target(curve, 0.86) is None     # not reached
    assert convergence_summary.time_to_target(_curve([(1.0, None), (2.0, 0.9)]), 0.5) == 2.0


@pytest.mark.parametrize("times, expected", [
    ([10.0, None, 30.0], 30.0),          # "not reached" sorts last
    ([10.0, None, None], None),          # fewer than half reached it
    ([10.0, 20.0], 15.0),
    ([None, 20.0], None),
    ([], None),
])
def test_median_time_to_target_counts_not_reached_as_latest(times, expected):
    assert convergence_summary.median_time_to_target(times) == expected


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
    cells = {c["method"]: c for c in convergence_summary.summarize(runs)}
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
    ratio = convergence_summary.paired_time_ratio(times, base)
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
    assert set(full["methods"]) == {"tf_fp32", "tf_fp16", "gf_fp16", "default", "csc_1", "csc_1_ahead", "csc_auto",
                                    "lowrank_2"}
    assert len(convergence.matrix(**full)) == 4 * 8 * 3 * 2 * 2   # 4 tasks
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
    """(the GradientFlowAllReduce or None, --tf_all_reduce_dtype) that models.train builds from
    the method's trainer flags, as models.train.main does."""
    flag_values = copy.deepcopy(train.FLAGS)
    flag_values(["models.train", *methods.trainer_flags(method)])
    f = flag_values
    density = f.density if f["density"].present or f.reducer == "default" else "1"
    csc_momentum, _ = factory.split_momentum(f.momentum, f.momentum_correction, factory.parse_density(density))
    return factory.build_gradient_flow(f.compression, f.bytes_per_pack, density, f.chunk_size, f.warmup_steps,
                                       csc_momentum, f.selection, algorithm=f.algorithm, overlap=f.overlap,
                                       scoring=f.scoring, reducer=f.reducer, rank=f.rank,
                                       lowrank_alternate=f.lowrank_alternate), f.tf_all_reduce_dtype


def _settings(gradient_flow):
    """What two GradientFlowAllReduce objects must share to be the same method: the four
    settings, the reducer's class and handshake settings (CSC's: its density and a CRC of its
    other settings, warm-up included), ChunkSparsity's config."""
    compression = gradient_flow.compression
    return {"compression": getattr(compression, "name", compression), "bytes_per_pack": gradient_flow.bytes_per_pack,
            "algorithm": gradient_flow.algorithm, "overlap": gradient_flow.overlap,
            "reducer": type(gradient_flow.reducer).__name__,
            "reducer_settings": [(n, v) for n, v, _ in gradient_flow.reducer.settings()],
            "sparsity": None if gradient_flow.sparsity is None else gradient_flow.sparsity.get_config()}


@pytest.mark.parametrize("method", methods.METHODS)
def test_trainer_flags_build_the_gradient_flow_the_workers_build(method):
    """Every method of the table: models.train's GradientFlowAllReduce from `trainer_flags` is the
    workers' from `gradient_flow_kwargs` given the trainer's CSC warm-up (the workers' own is 0
    steps; the only difference allowed; 0 on local SGD's pseudo-gradient too); TF's methods
    build none."""
    import gf_tf
    trainer, dtype = _gradient_flow_of(method)
    if not methods.is_gradient_flow(method):
        assert trainer is None and dtype == methods.get(method).tf_dtype
        return
    warmup = 0 if methods.get(method).local else train.FLAGS["warmup_steps"].default
    worker = gf_tf.GradientFlowAllReduce(**methods.gradient_flow_kwargs(method, warmup_steps=warmup))
    assert trainer is not None and dtype == "float32"
    assert _settings(trainer) == _settings(worker)


@pytest.mark.parametrize("task", list(convergence.TASKS))
def test_each_tasks_shapes_are_its_models_trainable_variables(task):
    name = factory.model_for("", task)
    model = factory.build_model(name, factory.default_input_shape(name), 10)
    assert convergence.TASKS[task].shapes == tuple(tuple(w.shape) for w in model.trainable_weights)
    assert convergence.TASKS[task].params == sum(int(w.shape.num_elements()) for w in model.trainable_weights)


def test_the_estimates_bytes_are_the_shared_byte_model_and_auto_names_the_default(capsys):
    wide = convergence.TASKS["mnist1d_wide"]
    for method in ("csc_1", "csc_auto", "lowrank_2", "default"):
        assert convergence.payload_bytes_per_step("mnist1d_wide", method) == methods.payload_bytes(method, wide.shapes)
    # csc_auto at its dense rung: at least the dense FP16 bytes; low rank far below them.
    dense = methods.payload_bytes("gf_fp16", wide.shapes)
    assert methods.payload_bytes("csc_auto", wide.shapes) >= 2.0 * wide.params
    assert methods.payload_bytes("lowrank_2", wide.shapes) < dense / 10
    assert convergence.main(["--dry-run", "--tasks", "digits", "--methods", "tf_fp32,auto", "--seeds", "0",
                             "--workers", "2", "--links", "none"]) == 0
    assert "x methods ['tf_fp32', 'default'] x" in capsys.readouterr().out


@pytest.mark.slow
def test_a_tiny_local_sgd_cell_records_its_curve_and_the_bytes_of_its_steps_and_meetings():
    """digits, 2 workers on loopback, `local_16` for 2 epochs of 4 steps after 2 synchronous steps:
    the replicas meet at each epoch's end (H = 16 is longer than an epoch)."""
    params = sum(math.prod(shape) for shape in convergence.TASKS["digits"].shapes)
    statistics = 2 * (32 + 64)   # the CNN's BatchNorm moving means and variances, averaged at meetings
    extra = ["--epochs", "2", "--steps_per_epoch", "4", "--sync_warmup_steps", "2"]
    with tempfile.TemporaryDirectory() as workdir:
        run = convergence.run_local(("digits", 2, None, "local_16", 0), workdir, 600, extra)
    assert "error" not in run, run.get("error")
    curve = run["curve"]
    assert [p["epoch"] for p in curve] == [1, 2]
    assert 0 < curve[0]["seconds"] < curve[1]["seconds"]
    assert curve[-1]["test_accuracy"] == run["final_accuracy"] and 0 <= run["final_accuracy"] <= 1
    # FP16 packs with their slots (bounds a step ahead): a synchronous step sends the 10 gradients;
    # a meeting the pseudo-gradient of the same 10 weights and the 4 BatchNorm statistics; local
    # steps nothing. A pack whose bounds do not fit goes again in float32: the first synchronous
    # step's (no bounds yet), the statistics' at the first meeting, and any other whose bounds
    # moved (gf_tf.reducers.dense).
    step = 2 * (params + ahead_slots(10))
    meeting = step + 2 * (statistics + ahead_slots(4))
    weights_retry, statistics_retry = 4 * (params + 10), 4 * (statistics + 4)
    first, second = (p["bytes_sent"] for p in curve)
    retried = first - (2 * step + meeting)
    assert retried in {a * weights_retry + statistics_retry for a in (1, 2, 3)}, retried
    later = second - first - meeting
    assert later in {a * weights_retry + b * statistics_retry for a in (0, 1) for b in (0, 1)}, later
    assert run["sent_bytes_per_step"] == pytest.approx(second / 8)
