"""The network benchmarks' harness: emulated network, --quick runs, no-root refusal.

The --quick runs are the CI smoke test that keeps benchmarks/ from rotting: real
worker processes in network namespaces over a rate-limited link. They need root
(network namespaces, tc) and are skipped with that reason otherwise. The values
asserted are sanity bounds (a link cannot be beaten, exact sums are exact,
CSC 1% sends about 1% of the chunks), never speed targets: load on the machine
can only slow a run down, so no lower bound on a rate and no upper bound on a
time is asserted. Suspicious speeds are flagged in the benchmark's
own report (benchmarks.fit.sanity_notes).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import netem, report
from benchmarks.workers import gradients

# slow: the benchmarks' --quick runs start worker processes; their harness tests stay with them.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = f"gftest{os.getpid()}"     # never collides with a benchmark running on the machine
ENV = {**os.environ, "GF_BENCH_NETNS_PREFIX": PREFIX, "TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}

IS_ROOT = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the emulated network needs root (network namespaces, tc); "
                                                    "CI runs these as root")


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def _root_links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def _run_module(module, args, timeout, user=None):
    cmd = [sys.executable, "-m", module, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=timeout)


# ---- pure parts (no root) ------------------------------------------------------------------

def test_gradient_sets_match_the_published_networks():
    assert (len(gradients.resnet50_shapes()), gradients.num_elements(gradients.resnet50_shapes())) == (161, 25_557_032)
    assert (len(gradients.alexnet_shapes()), gradients.num_elements(gradients.alexnet_shapes())) == (16, 61_100_840)
    assert gradients.num_elements(gradients.resnet20_shapes()) == 269_722


def test_global_csc_methods_select_globally_and_stay_out_of_the_presets():
    from benchmarks import allreduce, fit
    from benchmarks.workers import methods
    _, whole = methods.make_strategy("csc_1_global", 30.0, build_strategy=False)
    _, per_pack = methods.make_strategy("csc_1", 30.0, build_strategy=False)
    assert (whole.sparsity.density, whole.sparsity.selection) == (0.01, "global")
    assert (per_pack.sparsity.density, per_pack.sparsity.selection) == (0.01, "per_pack")
    assert methods.LABELS["csc_0.1_global"] and methods.density("csc_0.1_global") == 0.001
    other = [m for m in methods.METHODS if methods.is_csc(m) and methods.csc_selection(m) != "per_pack"]
    for preset in ("targets", "full"):
        assert not any(l[2] in other for l in allreduce.preset_launches(preset))
        assert not any(l[3] in other for l in fit.preset_launches(preset))


def test_new_methods_pin_what_they_measure_and_auto_is_the_default():
    from benchmarks.workers import methods
    from gf_tf.plan import DEFAULT_BYTES_PER_PACK
    _, auto = methods.make_strategy("auto", 30.0, build_strategy=False)   # the old name of "default"
    assert (auto.compression, auto.bytes_per_pack, auto.algorithm, auto.sparsity) == \
        ("auto", "auto", "auto", None)
    for method, algorithm, density in (("gf_fp16", "ring", None), ("gf_fp16_rd", "recursive_doubling", None),
                                       ("csc_1", "ring", 0.01), ("csc_1_rd", "recursive_doubling", 0.01)):
        _, gf = methods.make_strategy(method, 30.0, build_strategy=False)
        assert gf.compression.name == "fp16" and gf.bytes_per_pack == DEFAULT_BYTES_PER_PACK == 4 * 2 ** 20
        assert gf.algorithm == algorithm, method
        assert (gf.sparsity.density if gf.sparsity is not None else None) == density, method
        assert methods.LABELS[method]
    assert methods.LABELS["default"] and methods.is_gradient_flow("auto") and "auto" not in methods.TABLE
    assert not {"default", "gf_fp16_rd", "csc_1_rd"} & set(methods.PRESET_METHODS)


def test_lowrank_methods_carry_their_rank_on_the_fp16_wire_outside_the_presets():
    import gf_tf
    from benchmarks.workers import methods
    for method, rank in (("lowrank_1", 1), ("lowrank_2", 2), ("lowrank_4", 4)):
        _, gf = methods.make_strategy(method, 30.0, build_strategy=False)
        assert isinstance(gf.reducer, gf_tf.reducers.LowRank) and gf.reducer.rank == rank
        assert gf.compression.name == "fp16" and gf.sparsity is None and methods.LABELS[method]
        assert method in methods.METHODS and method not in methods.PRESET_METHODS
        assert not gf.reducer.alternate


def test_the_acp_method_is_lowrank_2_sending_one_factor_a_step():
    import gf_tf
    from benchmarks.workers import methods
    _, gf = methods.make_strategy("lowrank_2_acp", 30.0, build_strategy=False)
    assert isinstance(gf.reducer, gf_tf.reducers.LowRank)
    assert gf.reducer.rank == 2 and gf.reducer.alternate and gf.compression.name == "fp16"
    assert "lowrank_2_acp" in methods.METHODS and "lowrank_2_acp" not in methods.PRESET_METHODS
    assert "ACP-SGD" in methods.LABELS["lowrank_2_acp"]


def test_tiny_gradient_set_is_a_few_kilobytes():
    assert len(gradients.GRADIENT_SETS["tiny"]) == 3
    assert gradients.num_elements(gradients.GRADIENT_SETS["tiny"]) == 996   # 3.9 kB of float32


def test_scale_preset_covers_issue_17s_cells_and_estimates_its_time():
    from benchmarks import allreduce
    launches = allreduce.preset_launches("scale")
    cells = {(n, rate, m, s) for n, rate, m, sets in launches for s in sets}
    for s in ("resnet20", "resnet50"):
        for rate in (100.0, 1000.0, None):
            for n in (2, 3, 4):
                for m in ("tf_fp32", "gf_fp16", "csc_1", "default"):
                    assert (n, rate, m, s) in cells
    for s in ("resnet20", "tiny"):
        for n in (6, 8):
            for m in ("tf_fp32", "gf_fp16", "gf_fp16_rd", "csc_1", "csc_1_rd", "default"):
                assert (n, 1000.0, m, s) in cells
    assert max(n for n, _, _, s in cells if s == "resnet50") == 4
    assert max(n for n, *_ in launches) == 8
    seconds = allreduce.estimate_matrix_seconds(launches, 5, 1, 3.0)
    configurations = {(n, rate) for n, rate, _, _ in launches}
    assert seconds == pytest.approx(sum(allreduce.estimate_launch_seconds(l, 5, 1) for l in launches)
                                    + len(configurations) * 5.0)
    assert [l[2] for l in allreduce.preset_launches("quick")] == ["tf_fp32", "gf_fp16", "csc_1", "default"]


def test_cells_carry_the_plan_and_costs_and_the_report_prints_them():
    from benchmarks import allreduce, allreduce_tables
    plan = {"method": "fp16", "algorithm": "recursive_doubling", "bytes_per_pack": 0, "seconds": 0.002,
            "describe": "fp16 packs (one pack per dtype), recursive doubling, predicted 2.00 ms per step"}
    chief = {"median_s": 0.01, "times_s": [0.01], "warmup_s": 1.0, "tx_bytes_per_iter": 1000.0,
             "rx_bytes_per_iter": 1000.0, "max_rel_error": 1e-4, "plans": [plan],
             "paired_s": 0.008, "paired_tf_s": 0.012}
    workers = [{"worker": w, "sets": {"tiny": chief}, "costs": [1e-3, 8e-3, 1e-9, 1e-9, 2e-9]}
               for w in range(2)]
    (cell,) = allreduce.derive_cells((2, 1000.0, "default", ["tiny"]), {"error": None, "workers": workers}, 9e8)
    assert cell["plans"] == [plan] and cell["costs"] == [1e-3, 8e-3, 1e-9, 1e-9, 2e-9]
    assert allreduce_tables.short_plan(cell["plans"]) == "fp16 rd 1 pack"
    assert allreduce_tables.short_plan([dict(plan, method="tf", algorithm="ring")]) == "tf"
    assert allreduce_tables.short_plan([dict(plan, algorithm="ring", bytes_per_pack=4 * 2 ** 20)]) == "fp16 ring 4MiB"
    report_text = allreduce_tables.plans_report([cell])
    assert "tiny, N=2, 1 Gbit/s, default: fp16 packs" in report_text and "1.000 ms/hop, 8.000 ms/round" in report_text
    assert "fp16 rd 1 pack" in allreduce_tables.results_table([cell])
    assert cell["paired_speedup"] == pytest.approx(0.012 / 0.008)   # TF's own / ours, same processes
    table = allreduce_tables.results_table([cell])
    assert "| paired vs TF |" in table and "1.5 |" in table


def test_cells_carry_the_cpu_seconds_of_encode_and_decode_and_csc_its_chunk_path_and_limit():
    from benchmarks import allreduce, allreduce_tables
    def chief(local_s):
        return {"median_s": 0.5, "times_s": [0.5], "warmup_s": 1.0, "tx_bytes_per_iter": 1000.0,
                "rx_bytes_per_iter": 1000.0, "sent_payload_bytes_per_iter": 800.0, "local_path_s": local_s}
    workers = [{"worker": w, "sets": {"tiny": chief(s)}} for w, s in enumerate((0.2, 0.4, 0.3))]
    outcome = {"error": None, "workers": workers}
    (dense,) = allreduce.derive_cells((3, 100.0, "gf_fp16", ["tiny"]), outcome, 1e4)
    (csc,) = allreduce.derive_cells((3, 100.0, "csc_1", ["tiny"]), outcome, 1e4)
    assert dense["cpu_s"] == csc["cpu_s"] == 0.3   # the median over the workers
    assert "chunk_path_s" not in dense and csc["chunk_path_s"] == 0.3
    bound = 2 * 2 / 3 * 800.0 * 8 / 1e4   # the ring bound: 2(N-1)/N x payload / goodput = 0.853 s
    assert csc["bound_s"] == pytest.approx(bound)
    assert csc["limit_s"] == pytest.approx(bound) and csc["ratio_to_limit"] == pytest.approx(0.5 / bound)
    header, _, row = allreduce_tables.results_table([dense]).splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    values = [c.strip() for c in row.strip("|").split("|")]
    assert values[columns.index("CPU s")] == "0.3" and values[columns.index("bound s")] == "0.853"


def test_repeated_launches_merge_into_the_median_launch_with_its_spread():
    from benchmarks import allreduce
    def cell(method, median, **extra):
        return {"set": "tiny", "workers": 2, "rate_mbit": None, "method": method, "median_s": median,
                **extra}
    cells = [cell("default", 0.30, launch=0, paired_speedup=0.9), cell("tf_fp32", 0.2),
             cell("default", 0.10, launch=1, paired_speedup=1.2), cell("tf_fp32", 0.4),
             cell("default", 0.20, launch=2, paired_speedup=1.0), cell("tf_fp32", 0.3),
             {"set": "tiny", "workers": 2, "rate_mbit": None, "method": "csc_1", "error": "boom"}]
    merged = {c["method"]: c for c in allreduce.merge_launches(cells)}
    assert merged["default"]["launch"] == 2 and merged["default"]["median_s"] == 0.20
    assert merged["default"]["launch_medians_s"] == [0.30, 0.10, 0.20]
    assert merged["default"]["launch_spread"] == pytest.approx((0.30 - 0.10) / 0.20)
    assert merged["default"]["paired_speedups"] == [0.9, 1.2, 1.0] and merged["default"]["paired_speedup"] == 1.0
    assert merged["tf_fp32"]["median_s"] == 0.3 and merged["csc_1"]["error"] == "boom"
    two = allreduce.merge_launches([cell("default", 0.4), cell("default", 0.2)])
    assert [c["median_s"] for c in two] == [0.2]   # an even count takes the lower middle launch
    allreduce.add_speedups(list(merged.values()))
    assert merged["default"]["speedup_vs_tf_fp32"] == pytest.approx(0.3 / 0.2)


def test_token_bucket_holds_whole_segments_and_lets_at_most_a_millisecond_through_free():
    # 100 Mbit/s: 16 KiB, 1.3 ms of the link (a bucket of 128 KiB let 10.5 ms through every step).
    assert [netem.tbf_burst_bytes(rate) for rate in (10, 100, 1000, 10000)] == [16384, 16384, 125000, 1250000]
    assert netem.tbf_burst_bytes(100) >= 4 * netem.SHAPED_GSO_MAX_BYTES   # tbf drops a packet above its bucket


def test_markdown_table_has_one_row_per_entry_and_aligned_columns():
    table = report.markdown_table(["a", "bb"], [[1.23456, None], ["x", 1234.5]]).splitlines()
    assert len(table) == 4 and len({len(line) for line in table}) == 1
    assert "1.23" in table[2] and "-" in table[2] and "1234" in table[3]


def test_fit_report_flags_implausible_scaling_and_only_that():
    from benchmarks import fit
    cells = [{"model": "digits_cnn", "workers": 2, "rate_mbit": 100.0, "method": "csc_1", "scaling_efficiency": 1.63},
             {"model": "digits_cnn", "workers": 2, "rate_mbit": None, "method": "tf_fp32", "scaling_efficiency": 0.9},
             {"model": "digits_cnn", "workers": 2, "rate_mbit": 100.0, "method": "gf_fp16", "error": "boom"}]
    notes = fit.sanity_notes(cells)
    assert len(notes) == 1
    assert "csc_1" in notes[0] and "scaling efficiency 1.63 > 1.3" in notes[0] and "load" in notes[0]


def test_overlap_is_the_hidden_share_of_the_shorter_of_compute_and_all_reduce():
    from benchmarks import overlap
    rng = np.random.default_rng()
    compute, comm = rng.uniform(0.01, 1.0, 2)
    shorter, longer = sorted((compute, comm))
    assert overlap.overlap_fraction(compute, comm, compute + comm) == pytest.approx(0.0, abs=1e-12)
    assert overlap.overlap_fraction(compute, comm, longer) == pytest.approx(1.0, rel=1e-12)
    step = longer + 0.25 * shorter                      # three quarters of the shorter hidden
    assert overlap.overlap_fraction(compute, comm, step) == pytest.approx(0.75, rel=1e-9)
    assert overlap.overlap_fraction(compute, comm, compute + comm + 0.1 * shorter) == pytest.approx(-0.1)
    assert overlap.overlap_fraction(0.0, comm, comm) is None   # nothing to hide


def _fit_cell(method, **extra):
    cell = {"model": "digits_cnn", "workers": 2, "rate_mbit": 100.0, "method": method, "params": 540_000,
            "images_per_s": 600.0, "median_step_s": 0.11, "steps": 4, "global_batch": 64,
            "loss_first": 2.3, "loss_last": 1.9, "losses_finite": True}
    return {**cell, **extra}


def test_fit_cells_carry_compute_all_reduce_step_and_overlap_into_json_and_table():
    from benchmarks import fit
    chief = {**_fit_cell("gf_fp16"), "step_times_s": [0.1, 0.11, 0.12], "warmup_epoch_s": 1.0,
             "compute_s": 0.08, "compute_step_times_s": [0.08] * 3, "allreduce_s": 0.05,
             "allreduce_times_s": [0.05] * 3, "profile_dir": "/tmp/p", "unrelated": 1}
    kept = fit.chief_fields(chief)
    assert "unrelated" not in kept and kept["compute_s"] == 0.08 and kept["allreduce_times_s"] == [0.05] * 3
    assert kept["profile_dir"] == "/tmp/p"
    cells = [_fit_cell("gf_fp16", compute_s=0.08, allreduce_s=0.05), _fit_cell("tf_fp32"),
             {"model": "digits_cnn", "workers": 2, "rate_mbit": 100.0, "method": "csc_1", "error": "boom"}]
    fit.derive(cells, {}, 2)
    assert cells[0]["step_s"] == 0.11
    assert cells[0]["overlap"] == pytest.approx((0.08 + 0.05 - 0.11) / 0.05)
    assert "overlap" not in cells[1] and cells[1]["step_s"] == 0.11   # measured with --no-overlap
    assert "step_s" not in cells[2]
    json.dumps(cells)                                   # the JSON holds them as they are
    table = fit.results_table(cells, {}).splitlines()
    header = [h.strip() for h in table[0].strip("|").split("|")]
    assert header[6:10] == ["step s", "compute s", "all-reduce s", "overlap"]
    row = [v.strip() for v in next(line for line in table if "gf_fp16" in line).strip("|").split("|")]
    assert [float(v) for v in row[6:10]] == pytest.approx([0.11, 0.08, 0.05, 0.4], abs=1e-3)
    failed = [v.strip() for v in next(line for line in table if "csc_1" in line).strip("|").split("|")]
    assert failed[5] == "FAILED" and failed[-1] == "boom" and len(failed) == len(header)


def test_fit_workers_get_the_overlap_and_profile_flags_and_methods_one_line_overrides(monkeypatch):
    from benchmarks import fit
    from benchmarks.workers import methods
    argv = fit.worker_argv("digits_cnn", "gf_fp16", None, 0, 60.0, True, "/tmp/prof/cell")
    assert "--overlap" in argv and argv[argv.index("--profile") + 1] == "/tmp/prof/cell"
    argv = fit.worker_argv("digits_cnn", "tf_fp32", None, 0, 60.0)
    assert "--overlap" not in argv and "--profile" not in argv
    assert "--overlap" not in fit.worker_argv("digits_cnn", None, None, 0, 60.0, True)   # the reference
    # One table entry is a method: its keywords reach GradientFlowAllReduce, on top of PINNED.
    assert methods.gradient_flow_settings("gf_fp16_rd") == {**methods.PINNED, "algorithm": "recursive_doubling"}
    methods.register(methods.Method("gf_fp16_big", "big packs", gradient_flow={"bytes_per_pack": 8 * 2 ** 20}))
    try:
        _, gf = methods.make_strategy("gf_fp16", 30.0, build_strategy=False)
        kwargs = methods.gradient_flow_kwargs("gf_fp16_big")
        assert kwargs == {"compression": "fp16", "bytes_per_pack": 8 * 2 ** 20, "algorithm": "ring",
                          "overlap": False}
        assert gf.bytes_per_pack == 4 * 2 ** 20 and methods.is_gradient_flow("gf_fp16_big")
    finally:
        methods.unregister("gf_fp16_big")


def test_compute_only_ops_keep_the_methods_local_work_and_pin_the_ring():
    import tensorflow as tf
    import gf_tf
    from benchmarks.workers import local_only
    assert isinstance(local_only.compute_only_ops("tf_fp32"), tf.distribute.ReductionToOneDevice)
    for method, density in (("gf_fp16_rd", None), ("csc_1", 0.01)):
        ops = local_only.compute_only_ops(method)
        assert isinstance(ops, gf_tf.GradientFlowAllReduce) and ops.algorithm == "ring"
        assert ops.compression.name == "fp16" and ops.bytes_per_pack == 4 * 2 ** 20
        assert isinstance(ops._wrapped, tf.distribute.ReductionToOneDevice)   # pylint: disable=protected-access
        assert (ops.sparsity.density if ops.sparsity is not None else None) == density
    with pytest.raises(ValueError, match="no plan"):
        local_only.compute_only_ops("auto")     # "auto" pins the real run's plan


def test_bad_cluster_arguments_are_rejected_before_touching_anything():
    with pytest.raises(ValueError, match="num_hosts"):
        netem.EmulatedCluster(0)
    with pytest.raises(ValueError, match="rate_mbit"):
        netem.EmulatedCluster(2, rate_mbit=-5)


def test_without_root_the_benchmark_refuses_and_changes_nothing():
    before = _namespaces() if shutil.which("ip") else None
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv is missing: cannot drop privileges to test the refusal")
        proc = _run_module("benchmarks.allreduce", ["--quick"], timeout=60, user=65534)
    else:
        proc = _run_module("benchmarks.allreduce", ["--quick"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "needs root" in proc.stderr and "Nothing was changed" in proc.stderr
    if before is not None:
        assert _namespaces() == before


# ---- emulated network (root) ---------------------------------------------------------------

@needs_root
def test_cluster_is_shaped_both_ways_idempotent_and_leaves_the_host_untouched():
    links_before = _root_links()
    cluster = netem.EmulatedCluster(2, rate_mbit=100, prefix=PREFIX)
    try:
        cluster.up()
        cluster.up()   # a second setup replaces the first
        assert sorted(n for n in _namespaces() if n.startswith(PREFIX)) == \
            sorted([f"{PREFIX}-br", f"{PREFIX}-h0", f"{PREFIX}-h1"])
        for ns, dev in ((f"{PREFIX}-h0", "eth0"), (f"{PREFIX}-br", "v0"), (f"{PREFIX}-br", "v1")):
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                   text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc, (ns, dev, qdisc)
        assert _root_links() == links_before   # nothing created or shaped in the root namespace
        goodput = cluster.measure_goodput(seconds=1.5)
        for bps in goodput["per_link_bps"]:
            assert 0 < bps <= 1.0e8, goodput     # the link is capped (~95.6 Mbit/s of payload when idle)
        counters = cluster.interface_bytes(0)
        assert counters["tx_bytes"] > 0
    finally:
        cluster.down()
        cluster.down()
    assert not [n for n in _namespaces() if n.startswith(PREFIX)]
    assert _root_links() == links_before


@needs_root
def test_interrupted_benchmark_removes_its_network(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.allreduce", "--quick", "--out",
                             str(tmp_path / "a.json")], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not [n for n in _namespaces() if n.startswith(PREFIX)]:
            assert time.time() < deadline and proc.poll() is None, "the cluster never came up"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "emulated network removed" in err
    assert not [n for n in _namespaces() if n.startswith(PREFIX)]


@needs_root
def test_allreduce_quick_reports_sane_figures(tmp_path):
    out = tmp_path / "allreduce.json"
    proc = _run_module("benchmarks.allreduce", ["--quick", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| resnet20")   # the table is printed last
    data = json.loads(out.read_text())
    goodput = data["goodput"][0]["used_bps"]
    assert 0 < goodput <= 1.0e8         # capped by the 100 Mbit/s link
    cells = {c["method"]: c for c in data["cells"]}
    assert "tf_fp32" in cells
    for method, c in cells.items():
        assert "error" not in c, c
        assert c["workers"] == 2 and c["rate_mbit"] == 100.0 and c["elements"] == 269_722
        assert len(c["times_s"]) == 2 and c["median_s"] > 0
        assert c["ratio_to_bound"] > 0.85, c     # no method beats the wire (load only raises this)
        if method in ("tf_fp32", "tf_fp16", "gf_fp16"):
            assert 0.85 < c["wire_over_ideal"] < 1.3, c   # counted on the interface, headers included
    assert cells["tf_fp32"]["max_rel_error"] == 0.0          # 2 x v is exact in float32
    assert cells["tf_fp32"]["payload_bytes"] == 4 * 269_722
    if "gf_fp16" in cells:
        assert cells["gf_fp16"]["max_rel_error"] < 2e-3
        assert cells["gf_fp16"]["payload_bytes"] == pytest.approx(2 * 269_722, rel=0.01)
        assert cells["gf_fp16"]["pack_unpack_s"] > 0
    if "csc_1" in cells:
        assert 0.005 < cells["csc_1"]["nonzero_fraction"] < 0.05
        assert cells["csc_1"]["payload_bytes"] < 0.1 * cells["tf_fp32"]["payload_bytes"]
        assert cells["csc_1"]["wire_tx_bytes_per_worker"] < 0.2 * cells["tf_fp32"]["wire_tx_bytes_per_worker"]
        assert cells["csc_1"]["chunk_path_s"] > 0   # timed in the same worker processes
        assert cells["csc_1"]["limit_s"] == max(cells["csc_1"]["bound_s"], cells["csc_1"]["chunk_path_s"])
    if "default" in cells:   # the default, and TF's own beside it in the same processes
        assert cells["default"]["max_rel_error"] < 2e-3 and cells["default"]["plans"]
        assert cells["default"]["paired_s"] > 0 and cells["default"]["paired_tf_s"] > 0
        assert cells["default"]["paired_speedup"] == cells["default"]["paired_tf_s"] / cells["default"]["paired_s"]
    assert not [n for n in _namespaces() if n.startswith(PREFIX)]


@needs_root
def test_fit_quick_runs_every_cell_with_finite_losses(tmp_path):
    out = tmp_path / "fit.json"
    proc = _run_module("benchmarks.fit", ["--quick", "--out", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| digits_cnn")
    data = json.loads(out.read_text())
    ref = data["references"]["digits_cnn"]
    assert ref["images_per_s"] > 0 and ref["losses_finite"]
    for c in data["cells"]:
        assert "error" not in c, c
        assert c["images_per_s"] > 0 and c["losses_finite"]
        assert c["global_batch"] == 2 * 32
        assert c["scaling_efficiency"] > 0   # its sanity is the report's job (fit.sanity_notes)
        assert c["compute_s"] > 0 and c["allreduce_s"] > 0 and c["step_s"] == c["median_step_s"]
        assert c["overlap"] == pytest.approx((c["compute_s"] + c["allreduce_s"] - c["step_s"])
                                             / min(c["compute_s"], c["allreduce_s"]))
        assert len(c["compute_step_times_s"]) == c["steps"] - 1 and len(c["allreduce_times_s"]) == c["steps"]
    assert not [n for n in _namespaces() if n.startswith(PREFIX)]
