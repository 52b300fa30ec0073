"""benchmarks.harness: the run loop's order and ports, the worker result schema, the entry-point frame."""

import json
import subprocess
import sys

import pytest

from benchmarks import harness


def test_a_worker_result_is_one_line_its_supervisor_reads_back(capsys):
    harness.write_result({"median_s": 0.25, "sets": {"tiny": [1, 2]}})
    printed = capsys.readouterr().out
    assert printed == 'RESULT {"median_s": 0.25, "sets": {"tiny": [1, 2]}}\n'
    assert harness.read_result("log line\n" + printed) == {"median_s": 0.25, "sets": {"tiny": [1, 2]}}
    assert harness.read_result('RESULT {"a": 1}\nRESULT {"a": 2}\n') == {"a": 2}   # the last one
    assert harness.read_result("no result\n") is None


def test_the_sweep_runs_by_n_then_slowest_link_first_with_one_port_per_cell():
    cells = [(4, None, "a"), (2, 1000.0, "b"), (2, None, "c"), (2, 100.0, "d"), (4, 100.0, "e"), (2, 100.0, "f")]
    calls, said = [], []

    def run(cluster, cell, port, goodput):
        calls.append((cluster, cell[2], port, goodput))
        return cell[2].upper(), f"ran {cell[2]}"

    outcomes = harness.sweep(cells, lambda c: c[0], lambda c: c[1], run, emulate=False, say=said.append)
    assert [name for _, name, _, _ in calls] == ["d", "f", "b", "c", "e", "a"]
    assert [port for _, _, port, _ in calls] == list(range(harness.BASE_PORT + 1, harness.BASE_PORT + 7))
    assert all(cluster is None and goodput is None for cluster, _, _, goodput in calls)   # not emulated
    assert outcomes == ["D", "F", "B", "C", "E", "A"]
    assert [line.split("  [")[0] for line in said] == [f"  ran {name}" for name in "dfbcea"]
    assert all(line.endswith("s]") for line in said)


def test_links_sort_slowest_first_and_unshaped_last_and_job_tags_are_file_names():
    assert sorted([None, 1000.0, 100.0, 56.0], key=harness.link_order) == [56.0, 100.0, 1000.0, None]
    assert harness.job_tag("csc_1", "n2", "1 Gbit/s") == "csc_1_n2_1Gbits"
    assert harness.job_tag("mnist1d", 2, 100.0, "csc_0.1", 0) == "mnist1d_2_100p0_csc_0p1_0"


def test_rates_and_lists_parse_or_exit_naming_the_flag():
    assert harness.parse_rates("100, 1000,none,unshaped,0") == [100.0, 1000.0, None, None, None]
    with pytest.raises(SystemExit, match="--rates: 'fast' is not a number"):
        harness.parse_rates("100,fast")
    assert harness.parse_list("a, b,", ["a", "b", "c"], "--sets") == ["a", "b"]
    with pytest.raises(SystemExit, match=r"--sets: unknown \['d'\]"):
        harness.parse_list("a,d", ["a", "b"], "--sets")


def test_the_header_names_the_run_and_the_load_average_on_this_machines_cores(monkeypatch):
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 7)
    meta = {"date_utc": "D", "cpu": "CPU", "logical_cpus": 7, "tensorflow": "2.21", "wall_seconds": 90.0}
    text = harness.header("All-reduce benchmark", meta, "3 timed iterations, ",
                          [{"load_average_1min": 2.5}, {"load_average_1min": 1.25}, {}])
    assert text == ("\nAll-reduce benchmark, D, CPU x7, TF 2.21, 3 timed iterations, wall 1.5 min\n"
                    "\n1-min load average of the machine (7 cores) at the end of each cell: 1.2 to 2.5; "
                    "other jobs slow the CPU-bound cells\n")
    assert harness.header("t", meta) == "\nt, D, CPU x7, TF 2.21, wall 1.5 min\n"


def test_a_jobs_tf_config_is_gf_tf_clusters(tmp_path):
    started = []

    class Cluster:   # the parts of netem.EmulatedCluster run_job uses, with plain local processes
        addresses = ["10.0.0.1", "10.0.0.2"]

        def popen(self, host, argv, env, stdout, stderr):
            started.append((host, json.loads(env["TF_CONFIG"])))
            code = "import os; print('RESULT ' + os.environ['TF_CONFIG'])"
            return subprocess.Popen([sys.executable, "-c", code], env={"TF_CONFIG": env["TF_CONFIG"]},
                                    stdout=stdout, stderr=stderr)

    job = harness.run_job(Cluster(), [["w0"], ["w1"]], 23001, timeout=60, log_dir=str(tmp_path), tag="t")
    spec = {"worker": ["10.0.0.1:23001", "10.0.0.2:23001"]}
    assert job["error"] is None
    assert job["results"] == [{"cluster": spec, "task": {"type": "worker", "index": i}} for i in (0, 1)]
    assert [host for host, _ in started] == [0, 1]
