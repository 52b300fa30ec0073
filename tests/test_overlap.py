"""Overlap: FP16 packs in groups, each with its own scale bounds' all-reduce.

Values and the traced step on 2 worker processes (tests/workers/overlap_worker.py,
TF_CONFIG on 127.0.0.1); the planner's rule on hand-computed cost cases.
"""

import numpy as np
import pytest

import cluster
import gf_tf
from gf_tf import reducers
from gf_tf.plan import Forecast, Plan, PlanReport, planner
from gf_tf.reducers import CostTerms
from csc_reference import NumpyCSC
from helpers import GIGABIT, GRADIENT_SCALE, make_costs

TIMEOUT, COMM_TIMEOUT = 180, 30




def _run(*args, workers=2):
    results = cluster.run_workers("overlap_worker.py", workers, list(args), timeout=TIMEOUT,
                                  comm_timeout=COMM_TIMEOUT)
    assert all(r.ok and r.result is not None for r in results), cluster.describe(results)
    return [r.result for r in results]


# -- values: overlapped and one barrier against a float64 reference ------------------------

@pytest.mark.slow
@pytest.mark.parametrize("algorithm,workers", [
    ("ring", 2), ("recursive_doubling", 2),
    ("recursive_doubling", 3),   # fold and unfold broadcasts, which carry no ordering token
])
def test_overlapped_and_one_barrier_sums_match_a_float64_reference(algorithm, workers):
    results = _run("--mode", "values", "--algorithm", algorithm, "--bytes_per_pack", "2048",
                   workers=workers)
    first = results[0]
    assert int(first["overlap_groups"]) > 2 and int(first["barrier_groups"]) == 1, \
        (first["overlap_plan"], first["barrier_plan"])
    assert "groups overlapped with backprop" in str(first["overlap_plan"])
    assert "one barrier" in str(first["barrier_plan"])
    names = [k[len("sent_"):] for k in first if k.startswith("sent_")]
    assert len(names) == 10
    for name in names:
        reference = np.sum([r[f"sent_{name}"] for r in results], axis=0)   # float64
        dtype = str(first[f"dtype_{name}"])
        # FP16 wire (float32 and float16 values): each tensor is scaled to its own bound B, the
        # SUM over workers of max |g|, so each of the 2N roundings (N casts, N - 1 partial sums,
        # the float16 output) is off by at most half a float16 ulp of B: 2**-10 N B, at any
        # magnitude (f32_tiny: ~1e-8, where unscaled FP16 subnormals would be off by up to 3e-8).
        # B, not the sum: a 1-element sum may cancel to far below its terms (CI once drew
        # 0.0139 from terms near 1). The float16 output adds its own rounding (subnormal ulp
        # 2**-24). BF16: 8-bit significand.
        bits = 7 if dtype == "bfloat16" else 10
        bound = np.sum([np.max(np.abs(r[f"sent_{name}"])) for r in results])
        atol = 2.0 ** -bits * len(results) * bound
        atol += 2.0 ** -24 if dtype == "float16" else 0.0
        for r in results:
            for form in ("overlap", "barrier"):
                got = r[f"{form}_{name}"]
                assert np.all(np.isfinite(got)), (name, form)   # no partial sum overflowed
                np.testing.assert_allclose(got, reference, rtol=0, atol=atol, err_msg=f"{name} {form}")
                np.testing.assert_array_equal(got, first[f"{form}_{name}"])   # every worker alike
            # A tensor's scale comes from its own bound in either form: the same bits.
            np.testing.assert_array_equal(r[f"overlap_{name}"], r[f"barrier_{name}"], err_msg=name)


# -- CSC: a group per pack, against one barrier and a float64 reference ----------------------

@pytest.mark.slow
@pytest.mark.parametrize("algorithm,workers", [("ring", 2), ("recursive_doubling", 3)])
def test_csc_in_groups_matches_one_barrier_bit_for_bit_and_a_float64_reference(algorithm, workers):
    seed = str(np.random.default_rng().integers(1 << 30))   # fresh, the same for both forms
    forms = {overlap: _run("--mode", "csc", "--overlap", overlap, "--algorithm", algorithm,
                           "--bytes_per_pack", "512", "--seed", seed, workers=workers)
             for overlap in ("on", "off")}
    on, off = forms["on"], forms["off"]
    packs = sorted(int(k[4:].split("_")[0]) for k in on[0] if k.endswith("_indices"))
    assert int(on[0]["groups"]) == len(packs) >= 4 and int(off[0]["groups"]) == 1
    for key in [k for k in on[0] if k != "groups"]:
        for r_on, r_off in zip(on, off):   # both forms: the same bits (sums, each own residual)
            np.testing.assert_array_equal(r_on[key], r_off[key], err_msg=key)
            if key.startswith("sum"):   # every worker holds the same sums
                np.testing.assert_array_equal(r_on[key], on[0][key], err_msg=key)
    # The float64 reference of each pack (tests/csc_reference.py's NumpyCSC; float32 wire).
    steps = sorted({int(k[3:].split("_")[0]) for k in on[0] if k.startswith("sum")})
    for p in packs:
        indices = [int(i) for i in on[0][f"pack{p}_indices"]]
        shapes = [on[0][f"sent0_{i}"].shape for i in indices]
        sizes = [int(np.prod(s)) for s in shapes]
        model = NumpyCSC(sum(sizes), workers, 16)
        for s in steps:
            flat = [np.concatenate([r[f"sent{s}_{i}"].ravel() for i in indices]) for r in on]
            want, _ = model.step(flat, 1.0 if s == 0 else 0.25)   # one dense warm-up step
            got = np.concatenate([on[0][f"sum{s}_{i}"].ravel() for i in indices])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"pack {p} step {s}")
        for r, result in enumerate(on):
            np.testing.assert_allclose(result[f"pack{p}_residual"], model.residual[r], rtol=1e-5,
                                       atol=1e-5 * np.abs(model.residual[r]).max() + 1e-30)


# -- the traced step of model.fit: the first group does not wait for the last gradients ---

@pytest.fixture(scope="module")
def fits():
    """(overlap on, overlap off, baseline) runs of the fit worker."""
    on = _run("--mode", "fit", "--overlap", "on")
    off = _run("--mode", "fit", "--overlap", "off")
    # Keras 3.6 and 3.7 train 2 workers on GRADIENT_SCALE x the global batch's gradient: for
    # plain SGD, the baseline's learning rate times that.
    baseline = cluster.run_process("overlap_worker.py", ["--mode", "fit", "--baseline",
                                                         f"--learning_rate={0.05 * GRADIENT_SCALE}"],
                                   timeout=TIMEOUT)
    assert baseline.ok, cluster.describe([baseline])
    return on, off, baseline.result


@pytest.mark.slow
def test_first_group_has_no_path_from_the_first_layers_gradient(fits):
    on, off, _ = fits
    for r in on:
        groups = int(r["groups"])
        assert groups >= 4 and int(r["groups_seen"]) == groups, str(r["plan"])
        # Per group: its float16 packs (>= 1), each carrying its bounds a step ahead (the
        # dense reducer: no bounds all-reduce of its own).
        assert np.all(r["collectives_per_group"] >= 1), r["collectives_per_group"]
        # The first layer's kernel gradient (computed last in backprop) is packed in the last
        # group; no op of the first group's collectives depends on it, through data or control.
        assert list(r["kernel_gradient_groups"]) == [groups - 1]
        assert not bool(r["first_reached_from_kernel"])
        assert bool(r["last_reached_from_kernel"])   # the walk does find paths that exist
        assert bool(r["groups_in_trace_order"])
    for r in off:
        # One barrier: the one group's bounds concatenate every tensor's, so its collectives,
        # the first ones of the step, wait for the first layer's gradient.
        assert int(r["groups"]) == 1 and int(r["groups_seen"]) == 1, str(r["plan"])
        assert list(r["kernel_gradient_groups"]) == [0]
        assert bool(r["first_reached_from_kernel"])


@pytest.mark.slow
def test_fit_with_overlap_is_identical_across_workers_and_close_to_float32(fits):
    on, off, baseline = fits
    keys = sorted((k for k in baseline if k[0] == "w"), key=lambda k: int(k[1:]))
    assert len(keys) == 8
    for k in keys:
        assert on[0][k].tobytes() == on[1][k].tobytes(), f"workers differ in {k}"
        np.testing.assert_allclose(on[0][k], baseline[k], atol=2e-3, rtol=0, err_msg=k)
        # Grouping changes no scale: the same bits as one barrier.
        np.testing.assert_array_equal(on[0][k], off[0][k], err_msg=k)
    assert any(np.any(on[0][k] != baseline[k]) for k in keys), "FP16 left no trace: did it run?"


@pytest.mark.slow
def test_csc_fit_in_groups_leaves_early_and_trains_as_one_barrier():
    on = _run("--mode", "fit", "--overlap", "on", "--density", "0.25", "--bytes_per_pack", "2048")
    off = _run("--mode", "fit", "--overlap", "off", "--density", "0.25", "--bytes_per_pack", "2048")
    for r in on:
        groups = int(r["groups"])
        assert groups >= 3 and int(r["groups_seen"]) == groups, str(r["plan"])
        # Per group: its chunk norms' all-reduce, then the switch_case over its chunk all-reduce.
        assert np.all(r["collectives_per_group"] == 2), r["collectives_per_group"]
        assert list(r["kernel_gradient_groups"]) == [groups - 1]
        assert not bool(r["first_reached_from_kernel"])
        assert bool(r["last_reached_from_kernel"]) and bool(r["groups_in_trace_order"])
    assert int(off[0]["groups"]) == 1 and bool(off[0]["first_reached_from_kernel"])
    keys = [k for k in on[0] if k[0] == "w" and k[1:].isdigit()]
    assert len(keys) == 8
    for k in keys:   # per-pack top k sees its own pack's norms only: the same training, bit for bit
        for r_on, r_off in zip(on, off):
            assert r_on[k].tobytes() == on[0][k].tobytes() == r_off[k].tobytes(), k


@pytest.mark.slow
def test_csc_ahead_in_groups_is_one_collective_per_group_that_leaves_before_the_last_gradient():
    """selection="ahead": each group's step is one Case (the warm-up's dense branch, or the
    sparse branch's one all-reduce); no norm all-reduce stands before it. The first group is
    not reached from the last layer's gradient, and grouping changes no bit."""
    args = ("--mode", "fit", "--density", "0.25", "--bytes_per_pack", "2048", "--selection", "ahead")
    on, off = _run(*args, "--overlap", "on"), _run(*args, "--overlap", "off")
    for r in on:
        groups = int(r["groups"])
        assert groups >= 3 and int(r["groups_seen"]) == groups, str(r["plan"])
        assert np.all(r["collectives_per_group"] == 1), r["collectives_per_group"]
        assert list(r["kernel_gradient_groups"]) == [groups - 1]
        assert not bool(r["first_reached_from_kernel"])
        assert bool(r["last_reached_from_kernel"]) and bool(r["groups_in_trace_order"])
    keys = [k for k in on[0] if k[0] == "w" and k[1:].isdigit()]
    for k in keys:
        for r_on, r_off in zip(on, off):
            assert r_on[k].tobytes() == on[0][k].tobytes() == r_off[k].tobytes(), k


@pytest.mark.slow
@pytest.mark.parametrize("density", ["0", "0.25"])
def test_fit_with_a_layers_kernel_and_bias_in_different_groups_trains(density):
    # oneDNN fuses a layer's Conv2DBackpropFilter (or MatMul) and BiasAddGrad of the same dy
    # into one node: control edges between groups once made that "nodes in a cycle".
    results = _run("--mode", "conv_fit", "--overlap", "on", "--bytes_per_pack", "2048",
                   "--density", density)
    assert int(results[0]["groups"]) >= 4
    for k in [k for k in results[0] if k[0] == "w"]:
        assert results[0][k].tobytes() == results[1][k].tobytes(), k
        assert np.all(np.isfinite(results[0][k])), k


@pytest.mark.slow
def test_workers_that_group_differently_fail_at_the_handshake():
    results = cluster.run_workers("overlap_worker.py", 2, ["--mode", "fit"], timeout=TIMEOUT,
                                  comm_timeout=COMM_TIMEOUT,
                                  per_worker_args=[["--overlap", "on"], ["--overlap", "off"]])
    for r in results:
        assert r.returncode not in (0, None), cluster.describe(results)
        assert "settings differ across workers" in r.output, cluster.describe(results)
        # 6 packs of 1024 bytes (the MLP's 8 gradients), one group each, against one barrier.
        assert "overlap groups: worker 0 = 6, worker 1 = 1" in r.output, cluster.describe(results)


# -- the planner's rule -----------------------------------------------------------------

def test_group_ranges_are_consecutive_and_balanced():
    assert reducers.group_ranges(6, 1) == [(0, 6)]
    assert reducers.group_ranges(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert reducers.group_ranges(3, 10) == [(0, 1), (1, 2), (2, 3)]   # never an empty group
    assert reducers.group_ranges(1, 0) == [(0, 1)]


def test_predicted_seconds_of_groups_by_hand():
    e, t, n, p = 25_600_000, 160, 2, 13
    lat = 2 * 1.5e-3                       # ring at N = 2: 2 hops
    wire, local = 2 / 2 * 2 * e * 8e-9, 2e-9 * e

    def control(tensors):
        return lat + 2 / 2 * 4 * tensors * 8e-9
    barrier = planner.predict_seconds("fp16", "ring", e, t, n, GIGABIT, p)
    assert barrier == pytest.approx(control(t) + p * lat + wire + local / p)
    # 4 groups: 4 control collectives of 40 tensors, the pipeline refills in each group.
    four = planner.predict_seconds("fp16", "ring", e, t, n, GIGABIT, p, groups=4)
    assert four == pytest.approx(4 * control(40) + p * lat + wire + local * 4 / p)
    last = planner.last_group_seconds("fp16", "ring", e, t, n, GIGABIT, p, 4)
    assert last == pytest.approx(control(40) + p / 4 * lat + wire / 4 + local / p)
    # Wires without bounds have no barrier to cut: groups change nothing.
    assert planner.predict_seconds("bf16", "ring", e, t, n, GIGABIT, p, groups=4) == \
        planner.predict_seconds("bf16", "ring", e, t, n, GIGABIT, p)


def _brute_force(e, t, n, costs, sizes):
    barrier_packs = planner.pack_options(e, "fp16", sizes[0])[0][0]
    budget = (1 + planner.OVERLAP_SLACK) * planner.predict_seconds("fp16", "ring", e, t, n, costs,
                                                                    barrier_packs)
    best = None
    for size in sizes:
        packs = -(-2 * e // size)
        for g in range(1, packs + 1):
            if planner.predict_seconds("fp16", "ring", e, t, n, costs, packs, g) <= budget:
                last = planner.last_group_seconds("fp16", "ring", e, t, n, costs, packs, g)
                if best is None or last < best[0]:
                    best = (last, size, g)
    return best


@pytest.mark.parametrize("elements,byte_s,expected", [
    (270_000, 8e-9, (4 << 20, 1)),      # ResNet-20, 1 Gbit/s: 1 pack; more cost a 3 ms collective each
    (270_000, 80e-9, (4 << 20, 1)),     # 100 Mbit/s: 3 small packs would add 9 ms to 50 ms (> 5%)
    (25_600_000, 8e-9, (4 << 20, 4)),   # ResNet-50, 1 Gbit/s: 13 packs, 4 groups within 5%
    (25_600_000, 80e-9, (1 << 20, 26)),  # 100 Mbit/s: the wire dominates, 1 MiB packs, 26 groups
])
def test_auto_overlap_takes_the_least_last_group_within_the_slack(elements, byte_s, expected):
    costs = make_costs(hop_s=1.5e-3, round_s=3e-3, byte_s=byte_s, copy_s=1e-9, fp16_s=2e-9)
    plan, forecast = planner.choose(elements, 160, 2, costs, "fp16", "ring", overlap="auto")
    assert (plan.bytes_per_pack, plan.groups) == expected, PlanReport(plan, forecast).describe()
    best = _brute_force(elements, 160, 2, costs, planner.OVERLAP_PACK_SIZES)
    assert (best[1], best[2]) == expected
    barrier, barrier_forecast = planner.choose(elements, 160, 2, costs, "fp16", "ring", overlap=False)
    assert barrier.groups == 1
    # never more than 5% slower
    assert forecast.seconds <= (1 + planner.OVERLAP_SLACK) * barrier_forecast.seconds
    if plan.groups > 1:
        assert forecast.last_seconds < barrier_forecast.seconds
        assert f"{plan.groups} groups overlapped with backprop" in PlanReport(plan, forecast).describe()


def test_pinned_and_unmeasured_settings_keep_their_form():
    # Without measurements "auto" is one barrier; True is one group per pack of the given size.
    assert planner.choose(10**7, 10, 2, None, "fp16", overlap="auto").plan.groups == 1
    unmeasured = planner.choose(10**7, 10, 2, None, "fp16", bytes_per_pack=1 << 20, overlap=True).plan
    assert (unmeasured.bytes_per_pack, unmeasured.groups) == (1 << 20, 20)
    # A pinned pack size is kept by "auto" and by True.
    plan = planner.choose(25_600_000, 160, 2, GIGABIT, "fp16", "ring", 1 << 20, overlap="auto").plan
    assert plan.bytes_per_pack == 1 << 20
    forced = planner.choose(25_600_000, 160, 2, GIGABIT, "fp16", "ring", 1 << 20, overlap=True).plan
    assert (forced.bytes_per_pack, forced.groups) == (1 << 20, 49)
    # True with "auto" packs: the size whose per-pack groups cost least, of those giving >= 2.
    small = planner.choose(270_000, 65, 2, GIGABIT, "fp16", "ring", overlap=True).plan
    assert (small.bytes_per_pack, small.groups) == (256 << 10, 3)
    # TF's own all-reduce and unscaled wires have nothing to group.
    assert planner.choose(1_000, 10, 2, GIGABIT, overlap=True) == planner.choose(1_000, 10, 2, GIGABIT)
    assert planner.choose(10**7, 10, 2, GIGABIT, "bf16", overlap=True).plan.groups == 1
    # The cut packs decide: one group per pack for True, never more groups than packs.
    assert planner.with_pack_count(Plan("fp16", 64, "ring", groups=5), 3, "auto").groups == 3
    assert planner.with_pack_count(Plan("fp16", 64, "ring", groups=2), 7, True).groups == 7
    assert planner.with_pack_count(Plan("tf", 0, "ring"), 0, True).groups == 1


def test_the_overlap_setting_is_checked_and_shown():
    for bad in ("yes", 1, None, 0.5):
        with pytest.raises(ValueError, match="overlap"):
            gf_tf.GradientFlowAllReduce(overlap=bad)
    gfar = gf_tf.GradientFlowAllReduce(compression="fp16", overlap=True)
    assert gfar.overlap is True and "overlap=True" in repr(gfar)
    assert gf_tf.GradientFlowAllReduce().overlap is False   # opt-in: nothing overlapped here yet
    assert PlanReport(Plan("fp16", 1024, "ring", groups=3),
                      Forecast(0.01, last_seconds=0.002)).describe() == (
        "fp16 packs (packs of 1024 bytes), ring, 3 groups overlapped with backprop, predicted "
        "10.00 ms per step (2.00 ms after the last gradient at best)")
    assert PlanReport(Plan("fp16", 1024, "ring")).describe() == \
        "fp16 packs (packs of 1024 bytes), ring, one barrier"



def test_csc_groups_by_hand():
    # AlexNet CSC 1% in 30 packs at N = 2 (ring: 2 hops of 1.5 ms per collective): norms 238,672 B,
    # chunks 1,222,656 B. all(G) = 2 G lat + W, last(G) = 2 lat + W / G, within 5% of all(1).
    latency, bytes_ = 2 * 1.5e-3, 238_672 + 1_222_656
    for byte_s, expected in ((8e-9, 1), (80e-9, 2)):   # 1 Gbit/s, 100 Mbit/s
        wire = bytes_ * byte_s   # 2(N-1)/N = 1 at N = 2
        costs = make_costs(hop_s=1.5e-3, round_s=3e-3, byte_s=byte_s, copy_s=1e-9, fp16_s=2e-9)
        fits = [g for g in range(1, 31) if 2 * g * latency + wire <= 1.05 * (2 * latency + wire)]
        assert max(fits) == expected
        csc = CostTerms((238_672, 1_222_656), groupable=True)
        assert planner.choose_fixed_groups(30, csc, 2, costs, "ring", "auto") == expected
    tiny = CostTerms((1, 1), groupable=True)
    assert planner.choose_fixed_groups(30, tiny, 2, GIGABIT, "ring", True) == 30
    assert planner.choose_fixed_groups(30, tiny, 2, GIGABIT, "ring", False) == 1
    assert planner.choose_fixed_groups(30, tiny, 2, None, "ring", "auto") == 1   # unmeasured


@pytest.mark.parametrize("sparsity,overlaps", [
    (dict(density=0.01), True), (dict(density=0.01, selection="global"), False),
    (dict(density="auto"), False)])
def test_csc_overlaps_only_with_per_pack_selection_at_a_fixed_density(sparsity, overlaps):
    assert gf_tf.ChunkSparsity(**sparsity).overlaps == overlaps
