"""benchmarks.projection: the step-time model's arithmetic on hand-computed cases, and its fit."""

import json
import math

import numpy as np
import pytest

from benchmarks import projection
from benchmarks.workers import gradients

PARAMS = {"alpha": 1e-3, "kappa": 1.1, "gamma": 2e-10, "delta_tf": 1e-9, "delta_gf": 3e-9,
          "delta_csc": 5e-9}


def test_all_reduce_seconds_by_hand():
    # N = 4 workers, 1e6 payload bytes in 3 collectives over 80 Mbit/s links, 2e5 elements,
    # 4 processes on 2 cores (s = 2):
    #   alpha: 1e-3 * 2 * 3 * 3                 = 0.018
    #   wire:  1.1 * 2 * 3/4 * 1e6 * 8 / 8e7    = 0.165
    #   gamma: 2e-10 * 3/4 * 1e6 * 2            = 0.0003
    #   local (GF FP16): 3e-9 * 2e5 * 2         = 0.0012
    case = projection.Case("gf_fp16", 4, 8e7, 200_000, 1e6, 3, cpu_share=2.0)
    assert projection.all_reduce_seconds(case, PARAMS) == pytest.approx(0.018 + 0.165 + 0.0003 + 0.0012,
                                                                        rel=1e-12)
    # The local term is the method's own: CSC's delta, not GF FP16's.
    csc = projection.Case("csc_1", 4, 8e7, 200_000, 1e6, 3, cpu_share=2.0)
    assert projection.all_reduce_seconds(csc, PARAMS) == pytest.approx(0.018 + 0.165 + 0.0003 + 0.002,
                                                                       rel=1e-12)


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


def test_method_traffic_matches_the_packing_and_chunk_rules():
    shapes = gradients.GRADIENT_SETS["resnet50"]
    elements = gradients.num_elements(shapes)
    packs = projection.pack_sizes(shapes)
    assert sum(packs) == elements
    assert projection.method_traffic("tf_fp32", shapes) == (4.0 * elements, 1)
    assert projection.method_traffic("gf_fp16", shapes) == (2.0 * elements + 4.0 * len(shapes),
                                                            len(packs) + 1)
    expected = sum(2.0 * max(1, math.ceil(0.01 * math.ceil(n / 1024))) * 1024 + 4.0 * math.ceil(n / 1024)
                   for n in packs)
    assert projection.method_traffic("csc_1", shapes) == (expected, 2)
    chunks = sum(math.ceil(n / 1024) for n in packs)     # global: one top K over all of them
    assert projection.method_traffic("csc_1_global", shapes) == (
        2.0 * math.ceil(0.01 * chunks) * 1024 + 4.0 * chunks, 2)


def test_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    cases = []
    for method in ("tf_fp32", "gf_fp16", "csc_1"):
        for n in (2, 3, 4):
            for link in (1e8, 1e9, 8e9):
                payload = {"tf_fp32": 1e8, "gf_fp16": 5e7, "csc_1": 6e5}[method] * rng.uniform(0.5, 2)
                cases.append(projection.Case(method, n, link, 25_000_000, payload,
                                             int(rng.integers(1, 16)), max(1.0, n / 2)))
    seconds = [projection.all_reduce_seconds(c, PARAMS) for c in cases]
    fitted = projection.fit(cases, seconds)
    for name, value in PARAMS.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


def test_fit_keeps_parameters_non_negative_and_needs_enough_cells():
    cases = [projection.Case("tf_fp32", n, 1e9, 1000, 4000.0, 1) for n in (2, 3, 4, 5, 6, 7)]
    # Times that fall with N would need a negative alpha: it is held at 0.
    fitted = projection.fit(cases, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    assert min(fitted.values()) >= 0.0
    with pytest.raises(ValueError, match="at least 6"):
        projection.fit(cases[:3], [1.0, 1.0, 1.0])


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

    # What `benchmarks.allreduce --quick` writes: 3 cells, fewer than the 6 parameters.
    cell = {"set": "resnet20", "workers": 2, "goodput_bps": 9.56e7, "median_s": 0.05,
            "elements": 270_000}
    quick = tmp_path / "quick.json"
    quick.write_text(json.dumps({"cells": [dict(cell, method=m) for m in ("tf_fp32", "gf_fp16", "csc_1")]}))
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(quick)])
    assert "hold 3 usable cells" in str(exc.value) and "needs at least 6" in str(exc.value)

    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        projection.main(["--fit", str(broken)])
    assert "is not a benchmarks.allreduce result" in str(exc.value)
