"""benchmarks.projection: the step-time model's arithmetic on hand-computed cases, and its fit."""

import json
import math

import numpy as np
import pytest

from benchmarks import projection, step_model
from benchmarks.workers import gradients, methods
from gf_tf.wire import ahead_slots
from gf_tf.plan import PlanReport, planner

PARAMS = {"alpha": 1e-3, "rho": 7e-3, "kappa": 1.1, "gamma": 2e-10, "delta_tf": 1e-9,
          "delta_gf": 3e-9, "delta_csc": 5e-9}


def test_all_reduce_seconds_by_hand():
    # N = 4 workers, 1e6 payload bytes in 3 collectives over 80 Mbit/s links, 2e5 elements,
    # 4 processes on 2 cores (s = 2):
    #   alpha: 1e-3 * 2 * 3 * 3                 = 0.018
    #   wire:  1.1 * 2 * 3/4 * 1e6 * 8 / 8e7    = 0.165
    #   gamma: 2e-10 * 3/4 * 1e6 * 2            = 0.0003
    #   local (GF FP16): 3e-9 * 2e5 * 2         = 0.0012
    case = step_model.Case("gf_fp16", 4, 8e7, 200_000, 1e6, 3, cpu_share=2.0)
    assert step_model.all_reduce_seconds(case, PARAMS) == pytest.approx(0.018 + 0.165 + 0.0003 + 0.0012,
                                                                        rel=1e-12)
    # The local term is the method's own: CSC's delta, not GF FP16's.
    csc = step_model.Case("csc_1", 4, 8e7, 200_000, 1e6, 3, cpu_share=2.0)
    assert step_model.all_reduce_seconds(csc, PARAMS) == pytest.approx(0.018 + 0.165 + 0.0003 + 0.002,
                                                                       rel=1e-12)


def test_recursive_doubling_seconds_by_hand():
    # N = 6 (not a power of two): 2 rounds of pairs + fold + unfold = 4 rounds; 3 collectives,
    # 1e6 payload bytes, 80 Mbit/s, 2e5 elements, s = 3:
    #   rho:   7e-3 * 4 * 3                     = 0.084
    #   wire:  1.1 * 4 * 1e6 * 8 / 8e7          = 0.44
    #   gamma: 2e-10 * 4/2 * 1e6 * 3            = 0.0012
    #   local (GF FP16): 3e-9 * 2e5 * 3         = 0.0018
    case = step_model.Case("gf_fp16_rd", 6, 8e7, 200_000, 1e6, 3, cpu_share=3.0)
    assert step_model.all_reduce_seconds(case, PARAMS) == pytest.approx(0.084 + 0.44 + 0.0012 + 0.0018,
                                                                        rel=1e-12)
    # alpha does not enter: the rounds have their own latency.
    assert step_model.all_reduce_seconds(case, PARAMS | {"alpha": 1.0}) == pytest.approx(
        step_model.all_reduce_seconds(case, PARAMS), rel=1e-12)


def test_step_time_hides_only_the_overlapped_share():
    # 90 ms of compute, 2/3 of it backprop: 50 ms of all-reduce hides entirely, 100 ms leaves 40 ms.
    assert projection.step_seconds(0.05, 0.09, 2 / 3) == pytest.approx(0.09)
    assert projection.step_seconds(0.10, 0.09, 2 / 3) == pytest.approx(0.13)
    assert projection.step_seconds(0.10, 0.09, 0.0) == pytest.approx(0.19)


def test_projection_speedup_by_hand():
    # TF default on AlexNet, 64 workers, 10 Gbit/s, alpha only plus wire (kappa 1):
    # payload 4 * 61,100,840 B in 1 collective; comm = 1e-4*2*63 + 2*63/64*244,403,360*8/1e10.
    params = dict.fromkeys(projection.PARAMETERS, 0.0) | {"alpha": 1e-4, "kappa": 1.0}
    elements = gradients.num_elements(gradients.GRADIENT_SETS["alexnet"])
    comm = 1e-4 * 2 * 63 + 2 * 63 / 64 * 4 * elements * 8 / 1e10
    p = projection.project(params, "alexnet", "tf_fp32", 64, 10.0, 0.04, 2 / 3)
    assert p["comm_s"] == pytest.approx(comm, rel=1e-12)
    assert p["speedup"] == pytest.approx(64 * 0.04 / (0.04 + comm), rel=1e-12)


def _pack_sizes(shapes):
    """Elements per pack of a float32 gradient list on the FP16 wire, as GradientFlow cuts it."""
    import tensorflow as tf
    from gf_tf import packing, wire
    from gf_tf.plan import DEFAULT_BYTES_PER_PACK
    plan = packing.plan_packs([(tf.TensorShape(s), tf.float32) for s in shapes], DEFAULT_BYTES_PER_PACK, wire.FP16)
    return [p.num_elements for p in plan]


def test_lowrank_traffic_by_hand():
    # One FP16 pack: a 64 x 32 kernel and a [3, 3, 16, 32] conv kernel (144 x 32) are compressed
    # at ranks 1, 2 and 4 (n m >= 2 (n + m) r); a bias (32) and a 4 x 3 kernel (12 < 2 (4 + 3) 1)
    # travel dense. Factors (96 + 176) r elements, dense 44, both 2 bytes an element; the control
    # vector 4 bytes x (2 dense bounds + 2 per matrix); collectives: the dense remainder, the
    # factors (2, or 1 sending P or Q in turn: half the factor elements on average), the control.
    shapes = [(64, 32), (3, 3, 16, 32), (32,), (4, 3)]
    assert len(_pack_sizes(shapes)) == 1
    for method, rank in (("lowrank_1", 1), ("lowrank_2", 2), ("lowrank_4", 4)):
        assert methods.traffic(method, shapes) == (2.0 * (272 * rank + 44) + 4.0 * 6, 4)
    assert methods.traffic("lowrank_2_acp", shapes) == (2.0 * (272 + 44) + 4.0 * 6, 3)


def test_the_projection_table_prints_the_lowrank_methods():
    """A row per low-rank method; at 1 Gbit/s on AlexNet the ACP form's one factor collective
    and half the factor bytes make its all-reduce shorter than lowrank_2's, and all of them
    a tenth of TF's float32 or less (PARAMS' local cost bounds them below)."""
    table, points = projection.projection_table(PARAMS, {"alexnet": 38.8}, [8], [1.0], 0.0)
    for method in ("lowrank_1", "lowrank_2", "lowrank_4", "lowrank_2_acp"):
        assert methods.LABELS[method] in table
    comm = {p["method"]: p["comm_s"] for p in points}
    assert comm["lowrank_2_acp"] < comm["lowrank_2"] < comm["lowrank_4"] < comm["tf_fp32"] / 10


def test_method_traffic_matches_the_packing_and_chunk_rules():
    shapes = gradients.GRADIENT_SETS["resnet50"]
    elements = gradients.num_elements(shapes)
    packs = _pack_sizes(shapes)
    assert sum(packs) == elements
    assert methods.traffic("tf_fp32", shapes) == (4.0 * elements, 1)
    # One collective per pack: the values and their slots (the dense reducer, scaled a step ahead).
    assert methods.traffic("gf_fp16", shapes) == (
        2.0 * (elements + 2 * len(shapes) + len(packs) * ahead_slots(0)), len(packs))
    expected = sum(2.0 * max(1, math.ceil(0.01 * math.ceil(n / 1024))) * 1024 + 4.0 * math.ceil(n / 1024)
                   for n in packs)
    assert methods.traffic("csc_1", shapes) == (expected, 2)
    chunks = sum(math.ceil(n / 1024) for n in packs)     # global: one top K over all of them
    assert methods.traffic("csc_1_global", shapes) == (
        2.0 * math.ceil(0.01 * chunks) * 1024 + 4.0 * chunks, 2)


def test_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    cases = []
    for method in ("tf_fp32", "gf_fp16", "csc_1", "gf_fp16_rd", "csc_1_rd"):
        for n in (2, 3, 4, 6, 8):
            for link in (1e8, 1e9, 8e9):
                payload = {"tf_fp32": 1e8, "gf_fp16": 5e7, "csc_1": 6e5, "gf_fp16_rd": 5e7,
                           "csc_1_rd": 6e5}[method] * rng.uniform(0.5, 2)
                cases.append(step_model.Case(method, n, link, 25_000_000, payload,
                                             int(rng.integers(1, 16)), max(1.0, n / 2)))
    seconds = [step_model.all_reduce_seconds(c, PARAMS) for c in cases]
    fitted = step_model.fit(cases, seconds)
    for name, value in PARAMS.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


def test_fit_keeps_parameters_non_negative_and_needs_enough_cells():
    cases = [step_model.Case("tf_fp32", n, 1e9, 1000, 4000.0, 1) for n in (2, 3, 4, 5, 6, 7, 8)]
    # Times that fall with N would need a negative alpha: it is held at 0.
    fitted = step_model.fit(cases, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert min(fitted.values()) >= 0.0
    assert fitted["rho"] == pytest.approx(2 * fitted["alpha"])   # no recursive-doubling cells
    with pytest.raises(ValueError, match="at least 7"):
        step_model.fit(cases[:3], [1.0, 1.0, 1.0])


def test_alpha_for_speedup_is_the_break_even_latency():
    params = dict.fromkeys(projection.PARAMETERS, 0.0) | {"kappa": 1.0}
    alpha = projection.alpha_for_speedup(params, 400.0, "alexnet", "csc_0.1", 512, 56.0, 0.0388, 2 / 3)
    assert alpha is not None and alpha > 0
    reached = projection.project(params | {"alpha": alpha}, "alexnet", "csc_0.1", 512, 56.0, 0.0388, 2 / 3)
    assert reached["speedup"] == pytest.approx(400.0, rel=1e-6)
    # Dense FP32 cannot reach 400x on 56 Gbit/s whatever the latency: its bytes alone cost too much.
    assert projection.alpha_for_speedup(params, 400.0, "alexnet", "tf_fp32", 512, 56.0, 0.0388, 0.0) is None


def test_missing_or_small_calibration_fails_with_what_to_run(tmp_path, capsys):
    missing = tmp_path / "allreduce.json"
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(missing)])
    assert f"no measurements at {missing}" in str(exc.value)
    assert "python -m benchmarks.allreduce" in str(exc.value)

    # What `benchmarks.allreduce --quick` writes: 3 cells, fewer than the 7 parameters.
    cell = {"set": "resnet20", "workers": 2, "goodput_bps": 9.56e7, "median_s": 0.05,
            "elements": 270_000}
    quick = tmp_path / "quick.json"
    quick.write_text(json.dumps({"cells": [dict(cell, method=m) for m in ("tf_fp32", "gf_fp16", "csc_1")]}))
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(quick)])
    assert "hold 3 usable cells" in str(exc.value) and "needs at least 7" in str(exc.value)

    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(broken)])
    assert "is not a benchmarks.allreduce result" in str(exc.value)


# -- gf_tf's default ("default"): the planner's pick on the fitted constants ---------------------

def test_planner_costs_carry_the_same_model():
    # TF's default and one-pack FP16 (ring or recursive doubling): the planner's predicted
    # seconds on planner_costs(...) are the projection's own model of the same traffic.
    shapes = gradients.GRADIENT_SETS["resnet20"]
    elements, tensors = gradients.num_elements(shapes), len(shapes)
    for n in (3, 8, 64):
        costs = projection.planner_costs(PARAMS, 2e9, cpu_share=1.5)
        for method, wire, algorithm in (("tf_fp32", "tf", "ring"), ("gf_fp16", "fp16", "ring"),
                                        ("gf_fp16_rd", "fp16", "recursive_doubling")):
            payload, collectives = methods.traffic(method, shapes, bytes_per_pack=0)
            case = step_model.Case(method, n, 2e9, elements, payload, collectives, cpu_share=1.5)
            assert planner.predict_seconds(wire, algorithm, elements, tensors, n, costs,
                                           control=False) == \
                pytest.approx(step_model.all_reduce_seconds(case, PARAMS), rel=1e-12), (method, n)


def test_auto_is_the_planners_pick_on_hand_made_costs():
    # Latency-bound (hops of 10 ms, rounds of 1 s, a free wire): one ring collective; TF's own
    # and one float32 pack then cost the same, and ties go to TF's own.
    latency = dict.fromkeys(projection.PARAMETERS, 0.0) | {"alpha": 1e-2, "rho": 1.0, "kappa": 1e-6}
    p = projection.project(latency, "resnet50", "default", 64, 56.0, 0.128, 0.0)
    assert (p["plan"].plan.method, p["plan"].plan.algorithm) == ("tf", "ring")
    tf_fp32 = projection.project(latency, "resnet50", "tf_fp32", 64, 56.0, 0.128, 0.0)
    assert p["comm_s"] == pytest.approx(tf_fp32["comm_s"], rel=1e-12)
    # Bandwidth-bound (1 Gbit/s, no latency): FP16 halves the bytes; the ring sends 2(N-1)/N of
    # them, recursive doubling log2(N) times them: FP16 over the ring, in 4 MiB packs (auto's size).
    wire = dict.fromkeys(projection.PARAMETERS, 0.0) | {"kappa": 1.0}
    p = projection.project(wire, "resnet50", "default", 64, 1.0, 0.128, 0.0)
    plan = p["plan"].plan
    assert (plan.method, plan.algorithm, plan.bytes_per_pack) == ("fp16", "ring", 4 << 20)
    e, t, packs = 25_557_032, 161, 13   # 13 packs of 4 MiB, each with its slots
    slots = 2 * t + packs * ahead_slots(0)
    assert p["comm_s"] == pytest.approx(2 * 63 / 64 * (2 * e + 2 * slots) * 8 / 1e9,
                                        rel=1e-12)
    # Rounds cheap, hops dear, a tiny set: FP16 packs scaled a step ahead (one collective, the
    # bounds in its slots) over recursive doubling: 6 rounds of (10 us + its bytes at 10 Gbit/s).
    rounds = dict.fromkeys(projection.PARAMETERS, 0.0) | {"alpha": 1e-3, "rho": 1e-5, "kappa": 1.0}
    p = projection.project(rounds, "tiny", "default", 64, 10.0, 0.01, 0.0)
    assert (p["plan"].plan.method, p["plan"].plan.algorithm) == ("fp16", "recursive_doubling")
    t = len(gradients.GRADIENT_SETS["tiny"])
    assert p["comm_s"] == pytest.approx(6 * (1e-5 + 2 * (996 + ahead_slots(t)) * 8 / 1e10), rel=1e-12)
    # And in general it is exactly gf_tf.plan.planner.choose on planner_costs.
    for model in ("alexnet", "resnet50"):
        for n in (8, 64, 512):
            chosen = PlanReport(*planner.choose(gradients.num_elements(gradients.GRADIENT_SETS[model]),
                                                len(gradients.GRADIENT_SETS[model]), n,
                                                projection.planner_costs(PARAMS, 25e9),
                                                control=False))
            p = projection.project(PARAMS, model, "default", n, 25.0, 0.05, 0.0)
            assert p["plan"] == chosen and p["comm_s"] == chosen.steady_seconds   # a trial: the faster


# -- the shipped calibration, --json, held-out validation --------------------------------------

def _synthetic_calibration(path, params, cores=2):
    """A benchmarks.allreduce-shaped JSON whose times are the model's own for `params`."""
    cells = []
    for method in ("tf_fp32", "gf_fp16", "csc_1", "gf_fp16_rd", "csc_1_rd"):
        for name in ("tiny", "resnet20"):
            for n in (2, 3, 4, 6, 8):
                for rate, goodput in ((100.0, 9.5e7), (1000.0, 9.4e8), (None, 8e9)):
                    shapes = gradients.GRADIENT_SETS[name]
                    payload, collectives = methods.traffic(method, shapes)
                    case = step_model.Case(method, n, goodput, gradients.num_elements(shapes), payload,
                                           collectives, max(1.0, n / cores))
                    cells.append({"set": name, "workers": n, "rate_mbit": rate, "method": method,
                                  "elements": case.elements, "goodput_bps": goodput,
                                  "median_s": step_model.all_reduce_seconds(case, params)})
    # A "default" cell ("auto", as here, in files written before the method table) is modelled
    # by its recorded plan; tf_fp16 has no model and is skipped.
    auto = dict(cells[0], method="auto", plans=[{"method": "tf", "algorithm": "ring", "bytes_per_pack": 0}])
    path.write_text(json.dumps({"cells": cells + [auto, dict(cells[0], method="tf_fp16")]}))
    return len(cells) + 1


def test_no_arguments_read_the_shipped_calibration_and_json_rows(tmp_path, monkeypatch, capsys):
    calibration = tmp_path / "allreduce.json"
    count = _synthetic_calibration(calibration, PARAMS)
    monkeypatch.setattr(projection, "DEFAULT_CALIBRATION", str(calibration))
    out = tmp_path / "out.json"
    assert projection.main(["--cores", "2", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert f"Fitted on {count} cells" in printed and "N=512" in printed and " alexnet |" in printed
    data = json.loads(out.read_text())
    keys = {"model", "method", "workers", "link_gbit", "alpha_us", "local_scale", "step_ms", "speedup",
            "efficiency"}
    assert data["rows"] and all(set(row) == keys for row in data["rows"])
    assert {r["workers"] for r in data["rows"]} == {8, 16, 32, 64, 128, 256, 512}
    assert {r["method"] for r in data["rows"]} == set(projection.PROJECTED_METHODS)
    assert {r["model"] for r in data["rows"]} == {"alexnet", "resnet50"}
    # Fitting on the model's own times recovers its parameters.
    for name, value in PARAMS.items():
        assert data["fitted_parameters"][name] == pytest.approx(value, rel=1e-6), name
    # Held out: fitted on N <= 4, N = 6 and 8 predicted to rounding.
    validation = data["validation"]
    assert validation["fit_workers"] == [2, 3, 4] and validation["held_out_workers"] == [6, 8]
    assert validation["worst_abs_error"] < 1e-6 and validation["median_abs_error"] < 1e-6
    # No FP16 overlap credit by default: every step is compute + all-reduce.
    params = data["projected_parameters"]
    for row in data["rows"]:
        if row["method"] == "gf_fp16" and row["link_gbit"] == 56.0:
            p = projection.project(params, row["model"], "gf_fp16", row["workers"], 56.0,
                                   projection.DEFAULT_COMPUTE_MS[row["model"]] / 1e3, 0.0)
            assert row["step_ms"] == pytest.approx(p["step_s"] * 1e3, rel=1e-12)
            assert row["step_ms"] == pytest.approx(projection.DEFAULT_COMPUTE_MS[row["model"]]
                                                   + p["comm_s"] * 1e3, rel=1e-12)
        if row["method"] == "default":
            p = projection.project(params, row["model"], "default", row["workers"], row["link_gbit"],
                                   projection.DEFAULT_COMPUTE_MS[row["model"]] / 1e3, 0.0)
            assert row["speedup"] == pytest.approx(p["speedup"], rel=1e-12)


def test_shipped_calibration_missing_or_unreadable_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(projection, "DEFAULT_CALIBRATION", str(tmp_path / "absent.json"))
    with pytest.raises(SystemExit) as exc:
        projection.main([])
    assert "no measurements at" in str(exc.value) and "--preset scale" in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(tmp_path)])            # a directory: unreadable
    assert "cannot read" in str(exc.value) and "\n" not in str(exc.value)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"cells": [1, 2]}))
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(odd)])
    assert "is not a benchmarks.allreduce result" in str(exc.value)


def test_held_out_validation_needs_both_sides():
    cells = [(step_model.Case("tf_fp32", 2, 1e9, 1000, 4000.0, 1), 1.0, {})] * 3
    assert "skipped" in step_model.held_out_validation(cells, [2, 3, 4])


def test_measured_overlap_from_a_fit_json_replaces_the_assumed_share(tmp_path, monkeypatch, capsys):
    from benchmarks import overlap
    cell = {"model": "alexnet", "workers": 2, "rate_mbit": 100.0}
    fit_json = tmp_path / "fit.json"
    fit_json.write_text(json.dumps({"cells": [
        dict(cell, method="gf_fp16", overlap=0.5), dict(cell, method="gf_fp16", overlap=0.7),
        dict(cell, method="gf_fp16", overlap=0.9),               # median 0.7
        dict(cell, method="csc_1", overlap=1.4),                  # clamped to 1
        dict(cell, method="tf_fp32", error="boom"),               # no overlap measured: skipped
        dict(cell, model="resnet50", method="csc_1", overlap=-0.2)]}))   # clamped to 0
    measured = overlap.measured_overlaps(str(fit_json))
    assert measured == {("alexnet", "gf_fp16"): pytest.approx(0.7), ("alexnet", "csc_1"): 1.0,
                        ("resnet50", "csc_1"): 0.0}
    params = dict.fromkeys(projection.PARAMETERS, 0.0) | {"alpha": 1e-4, "kappa": 1.0}
    for method, fraction in (("gf_fp16", 0.7), ("csc_1", 1.0), ("tf_fp32", 0.0)):
        p = projection.project(params, "alexnet", method, 64, 10.0, 0.04, measured)
        hidden = fraction * min(p["comm_s"], 0.04)
        assert p["step_s"] == pytest.approx(0.04 + p["comm_s"] - hidden, rel=1e-12), method
    # A measured model/method is not the assumed share: csc_1 hides nothing under --backward-share.
    assumed = projection.project(params, "alexnet", "csc_1", 64, 10.0, 0.04, 2 / 3)
    assert assumed["step_s"] == pytest.approx(0.04 + assumed["comm_s"], rel=1e-12)
    calibration = tmp_path / "allreduce.json"
    _synthetic_calibration(calibration, PARAMS)
    monkeypatch.setattr(projection, "DEFAULT_CALIBRATION", str(calibration))
    out = tmp_path / "out.json"
    assert projection.main(["--cores", "2", "--fit-json", str(fit_json), "--json", str(out),
                            "--plot", str(tmp_path / "p.png")]) == 0
    assert "alexnet/gf_fp16 0.70" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"model": "alexnet", "method": "csc_1", "overlap": 1.0} in data["overlap"]
    row = next(r for r in data["rows"] if (r["model"], r["method"], r["workers"], r["link_gbit"])
               == ("resnet50", "gf_fp16", 8, 10.0))     # nothing measured for it: no overlap
    p = projection.project(data["projected_parameters"], "resnet50", "gf_fp16", 8, 10.0,
                           projection.DEFAULT_COMPUTE_MS["resnet50"] / 1e3, 0.0)
    assert row["step_ms"] == pytest.approx(p["step_s"] * 1e3, rel=1e-12)
    with pytest.raises(SystemExit):                        # either the assumed share or the measured one
        projection.main(["--fit-json", str(fit_json), "--backward-share", "0.5"])
    with pytest.raises(SystemExit, match="cannot read"):
        overlap.measured_overlaps(str(tmp_path / "absent.json"))
