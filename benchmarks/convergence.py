r"""Time to accuracy: tasks x methods x seeds x N x link, each run a real `gf-tf-run` job of `models.train`.

    python -m benchmarks.convergence --dry-run                 # the matrix and its time estimate
    sudo python -m benchmarks.convergence --quick              # mnist1d_wide, tf_fp32 and csc_1, seed 0
    sudo python -m benchmarks.convergence --report             # the whole matrix, dated report
    python -m benchmarks.convergence --tasks digits --methods tf_fp32,default --seeds 0 --workers 2 --links none
    python -m benchmarks.convergence --merge a.json b.json --out all.json   # summarize earlier outputs

Each run trains `python -m models.train --dataset TASK --curve` with its method's flags
(`methods.trainer_flags`): on an emulated link one worker per network namespace (root), unshaped over
loopback. The columns: docs/benchmarks.md, "Time to accuracy"; the outputs: docs/benchmarks.md, "The tools in detail".
"""

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import convergence_summary as summary
from benchmarks import harness, netem, report
from benchmarks.workers import methods

# The methods are benchmarks.workers.methods.TABLE's: each run passes `methods.trainer_flags`;
# the full preset takes methods.CONVERGENCE_METHODS, the others run when named.


@dataclasses.dataclass(frozen=True)
class Task:
    """A models.train dataset and what the time estimate needs: the shapes of its model's
    trainable variables (elements per dimension, in the model's order), steps per epoch at
    batch 64, and the seconds per step of 2 workers on 2 cores over loopback (this machine's
    unshaped runs, rounded up)."""
    shapes: Tuple[Tuple[int, ...], ...]
    steps_per_epoch: int
    compute_s_per_step: float

    @property
    def params(self) -> int:
        """Trainable parameters (elements) of the model."""
        return sum(math.prod(s) for s in self.shapes)


# Listed, not built (building a model imports TensorFlow and Keras: seconds); each is
# models.factory.build_model(...).trainable_weights' shapes of the network named, which
# tests/test_convergence.py checks.
TASKS: Dict[str, Task] = {
    "digits": Task(shapes=((3, 3, 1, 32), (32,), (32,), (3, 3, 32, 64), (64,), (64,), (4096, 128),
                           (128,), (128, 10), (10,)),   # digits_cnn: 544,618 parameters
                   steps_per_epoch=22, compute_s_per_step=0.04),
    "mnist1d": Task(shapes=((5, 1, 25), (25,), (25,), (5, 25, 25), (25,), (25,), (5, 25, 25), (25,), (25,),
                            (125, 10), (10,)),   # mnist1d_cnn: 7,785
                    steps_per_epoch=62, compute_s_per_step=0.02),
    "mnist1d_wide": Task(shapes=((40, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)),   # wide_mlp: 1,101,834
                         steps_per_epoch=62, compute_s_per_step=0.03),
    # topic_attention: 533,578, of which the (8000, 64) embedding's gradient is IndexedSlices
    # (TensorFlow's own all-reduce for every method; the estimate prices it dense).
    "topics": Task(shapes=((8000, 64), (64, 2, 32), (2, 32), (64, 2, 32), (2, 32), (64, 2, 32), (2, 32),
                           (2, 32, 64), (64,), (64,), (64,), (64, 64), (64,), (64, 10), (10,)),
                   steps_per_epoch=78, compute_s_per_step=0.02),
}
EPOCHS = 10            # models.train's default
START_SECONDS = 5.0    # per run, plus START_SECONDS_PER_WORKER x N: start-up, tracing, the data, 10 evaluations
START_SECONDS_PER_WORKER = 3.5

Run = Tuple[str, int, Optional[float], str, int]   # (task, N, rate_mbit or None, method, seed)


def matrix(tasks: Sequence[str], methods: Sequence[str], seeds: Sequence[int], workers: Sequence[int],
           links: Sequence[Optional[float]]) -> List[Run]:
    """Every run, grouped by (N, link) so that each emulated cluster is set up once; tf_fp32 first
    in each group (the target comes from it)."""
    ordered = sorted(methods, key=lambda m: m != summary.BASELINE)
    return [(t, n, r, m, s) for n, r in itertools.product(workers, links)
            for t in tasks for s in seeds for m in ordered]


def preset(name: str, root: bool) -> Dict[str, list]:
    """The presets' axes: quick (one task, two methods, one seed) and full (the issue's matrix)."""
    if name == "quick":
        return {"tasks": ["mnist1d_wide"], "methods": ["tf_fp32", "csc_1"], "seeds": [0], "workers": [2],
                "links": [100.0 if root else None]}
    return {"tasks": list(TASKS), "methods": list(methods.CONVERGENCE_METHODS), "seeds": [0, 1, 2], "workers": [2, 4],
            "links": [100.0, None]}


def payload_bytes_per_step(task: str, method: str) -> float:
    """Bytes a worker puts into gradient all-reduces per step, at most (for time estimates): the
    shared byte model, `methods.payload_bytes` (csc_auto at its dense rung, the CSC methods
    after their warm-up)."""
    return methods.payload_bytes(method, TASKS[task].shapes)


def estimate_run_seconds(run: Run) -> float:
    """A rough run time: start-up + steps x (compute with N workers on 2 cores + the ring's link time)."""
    task, n, rate, method, _ = run
    t = TASKS[task]
    link = 0.0 if rate is None else 2 * (n - 1) / n * payload_bytes_per_step(task, method) * 8 / (rate * 0.95e6)
    compute = t.compute_s_per_step * max(1.0, n / 2)
    return START_SECONDS + START_SECONDS_PER_WORKER * n + EPOCHS * t.steps_per_epoch * (compute + link)


def train_argv(run: Run, model_dir: str, extra: Sequence[str] = ()) -> List[str]:
    """The `python -m models.train` command of a run: its task, seed and method's flags, then
    `extra` (later flags win)."""
    task, _, _, method, seed = run
    return [sys.executable, "-m", "models.train", "--dataset", task, "--seed", str(seed), "--curve",
            "--model_dir", model_dir, "--collective_timeout", "600", "--heartbeat_timeout", "120",
            *methods.trainer_flags(method), *extra]


def _launcher() -> str:
    return shutil.which("gf-tf-run") or os.path.join(os.path.dirname(sys.executable), "gf-tf-run")


def _outcome(run: Run, model_dir: str, error: Optional[str]) -> Dict:
    task, n, rate, method, seed = run
    out = {"task": task, "workers": n, "rate_mbit": rate, "method": method, "seed": seed,
           "load_average_1min": os.getloadavg()[0]}
    path = os.path.join(model_dir, "results.json")
    if error is None and not os.path.exists(path):
        error = "no results.json"
    if error is not None:
        return {**out, "error": error}
    with open(path) as f:
        result = json.load(f)
    return {**out, "model": result["model"], "final_accuracy": result["test_accuracy"],
            "sent_bytes_per_step": result["sent_bytes_per_step"],
            "dense_bytes_per_step": result["dense_bytes_per_step"], "curve": result["curve"]}


def run_local(run: Run, workdir: str, timeout: float, extra: Sequence[str] = ()) -> Dict:
    """One unshaped run: `gf-tf-run -n N` on this machine (no root needed); `extra`: more
    models.train flags."""
    model_dir = os.path.join(workdir, harness.job_tag(*run))
    env = dict(os.environ, PYTHONPATH=netem.REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    try:
        proc = subprocess.run([_launcher(), "-n", str(run[1]), "--", *train_argv(run, model_dir, extra)],
                              cwd=netem.REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        error = f"not finished after {timeout:.0f} s"
    return _outcome(run, model_dir, error)


def run_emulated(cluster: netem.EmulatedCluster, run: Run, port: int, workdir: str, timeout: float,
                 log_dir: str) -> Dict:
    """One run on the emulated cluster: worker i in namespace i, `gf-tf-run` running the task its
    TF_CONFIG names; benchmarks.workers.train_job prints the chief's results.json as its RESULT."""
    model_dir = os.path.join(workdir, harness.job_tag(*run))
    argv = [sys.executable, "-m", "benchmarks.workers.train_job", model_dir, _launcher(), "--",
            *train_argv(run, model_dir)]
    job = harness.run_job(cluster, [argv] * run[1], port, timeout=timeout, log_dir=log_dir,
                          tag=harness.job_tag(*run))
    return _outcome(run, model_dir, job["error"])


def run_matrix(runs: List[Run], timeout: float) -> List[Dict]:
    """Runs every run, unshaped ones locally without root, the others on an emulated cluster per N."""
    workdir = tempfile.mkdtemp(prefix="gf_tf_convergence_")
    log_dir = os.path.join(workdir, "logs")
    os.makedirs(log_dir)

    def one(cluster, run: Run, port: int, _goodput) -> Tuple[Dict, str]:
        result = (run_emulated(cluster, run, port, workdir, timeout, log_dir) if cluster
                  else run_local(run, workdir, timeout))
        return result, (f"{run[0]} N={run[1]} {report.link_label(run[2])} {run[3]} seed {run[4]}: "
                        + (f"FAILED: {result['error']}" if "error" in result
                           else f"accuracy {result['final_accuracy']:.4f}")
                        + f", load {result['load_average_1min']:.1f}")

    emulate = os.geteuid() == 0 or any(r[2] is not None for r in runs)
    return harness.sweep(runs, lambda r: r[1], lambda r: r[2], one, emulate=emulate)


def _against_target(value: Optional[float], target: Optional[float], fmt: str) -> str:
    """A time-to-target cell: "-" without a target, "not reached" for None, else `value` in `fmt`."""
    if target is None:
        return "-"
    return "not reached" if value is None else fmt.format(value)


def tables(cells: List[Dict]) -> str:
    """One Markdown table per (task, N, link), methods in the table's order, the load average above it."""
    order = methods.METHODS
    out = []
    task_order = {task: i for i, task in enumerate(TASKS)}
    for key in sorted({(c["task"], c["workers"], c["rate_mbit"]) for c in cells},
                      key=lambda k: (task_order.get(k[0], 99), k[1], *harness.link_order(k[2]))):
        rows = sorted([c for c in cells if (c["task"], c["workers"], c["rate_mbit"]) == key],
                      key=lambda c: order.index(c["method"]) if c["method"] in order else 99)
        loads = [x for c in rows for x in c["load_average_1min"]]
        target = rows[0]["target"]
        out.append(f"{key[0]}, N={key[1]}, {report.link_label(key[2])}: target "
                   + ("-" if target is None else f"{100 * target:.2f}%")
                   + f" (tf_fp32's median final accuracy - 1 point); 1-min load average "
                   f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores\n")
        out.append(report.markdown_table(
            ["method", "seeds", "final acc %", "range %", "vs fp32 pt", "time to target", "time / fp32",
             "train s", "bytes/step"],
            [[c["method"], c["seeds"], 100 * c["final_accuracy_median"],
              f"{100 * c['final_accuracy_min']:.2f}-{100 * c['final_accuracy_max']:.2f}",
              None if c["vs_tf_fp32_points"] is None else f"{c['vs_tf_fp32_points']:+.2f}",
              _against_target(c["time_to_target_s"], c["target"], "{:.1f} s"),
              _against_target(c["time_vs_tf_fp32"], c["target"], "{:.2f}x"),
              c["seconds_median"],
              f"{c['bytes_per_step']:,.0f}"] for c in rows]) + "\n")
    return "\n".join(out)


def describe(runs: List[Run]) -> str:
    """The matrix's axes, size and estimated time (what --dry-run prints)."""
    axes = [sorted({r[i] for r in runs}, key=lambda x: (x is None, str(x))) for i in range(5)]
    seconds = sum(estimate_run_seconds(r) for r in runs)
    return (f"tasks {axes[0]} x methods {[m for m in methods.METHODS if m in axes[3]]} x seeds {axes[4]} x "
            f"N {axes[1]} x links {[report.link_label(r) for r in axes[2]]}: {len(runs)} runs, "
            f"estimated {seconds / 60:.0f} min ({seconds / 3600:.1f} h) on {os.cpu_count()} cores")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="mnist1d_wide, tf_fp32 and csc_1, seed 0, N=2, 100 Mbit/s with root (~5 min)")
    parser.add_argument("--dry-run", action="store_true", help="print the matrix and its time estimate, run nothing")
    parser.add_argument("--tasks", help=f"comma-separated subset of {list(TASKS)}")
    parser.add_argument("--methods", help=f"comma-separated subset of {methods.METHODS} (auto: default)")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--workers", help="comma-separated N (default 2,4)")
    parser.add_argument("--links", help="comma-separated Mbit/s or 'none' for unshaped (default 100,none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    parser.add_argument("--report", action="store_true",
                        help="write benchmarks/results/<date>-convergence.{md,json} from this run")
    parser.add_argument("--plots", action="store_true", help="draw the figures into docs/img/ (benchmarks.plots)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="run nothing: summarize the runs of these JSON outputs (a later file's run of "
                             "the same task, N, link, method and seed replaces an earlier one)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    axes = preset("quick" if args.quick else "full", os.geteuid() == 0)
    if args.tasks:
        axes["tasks"] = harness.parse_list(args.tasks, list(TASKS), "--tasks")
    if args.methods:
        axes["methods"] = methods.parse(args.methods)
    if args.seeds:
        axes["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.workers:
        axes["workers"] = [int(n) for n in args.workers.split(",")]
    if args.links:
        axes["links"] = harness.parse_rates(args.links)
    command = harness.command_line("convergence", argv)
    parts = ""
    if args.merge:
        payloads = []
        for path in args.merge:
            with open(path) as f:
                payloads.append(json.load(f))
        results = summary.merge_runs(payloads)
        meta = report.machine_description(command)
        meta["merged"] = [{key: p["meta"].get(key) for key in ("command", "date_utc", "git_commit", "wall_seconds",
                                                             "load_average_at_start", "load_average_at_end")}
                          for p in payloads]
        meta["wall_seconds"] = sum(p["meta"]["wall_seconds"] for p in payloads)
        meta["load_average_at_end"] = os.getloadavg()
        axes = {name: sorted({r[key] for r in results}, key=lambda x: (x is None, str(x)))
                for name, key in (("tasks", "task"), ("methods", "method"), ("seeds", "seed"),
                                  ("workers", "workers"), ("links", "rate_mbit"))}
        parts = "Runs merged from:\n\n" + "".join(
            f"- `{p['command']}`: started {p['date_utc']}, commit {p['git_commit']}, wall "
            f"{p['wall_seconds'] / 60:.1f} min, load average {p['load_average_at_start'][0]:.1f} at start, "
            f"{p['load_average_at_end'][0]:.1f} at end\n" for p in meta["merged"]) + "\n"
    else:
        runs = matrix(**axes)
        print(describe(runs), flush=True)
        if args.dry_run:
            for run in runs:
                print(f"  {run[0]:13s} N={run[1]} {report.link_label(run[2]):12s} {run[3]:12s} seed {run[4]}  "
                      f"~{estimate_run_seconds(run):.0f} s")
            return 0
        if os.geteuid() == 0 or any(r[2] is not None for r in runs):
            netem.require_root()
        meta = report.machine_description(command)
        started = time.time()
        results = run_matrix(runs, args.timeout)
        meta["wall_seconds"] = time.time() - started
        meta["load_average_at_end"] = os.getloadavg()
    cells = summary.summarize(results)
    payload = {"meta": meta, "axes": axes, "runs": results, "cells": cells}
    text = tables(cells)
    print(harness.header("time to accuracy", meta) + f"\n{text}")
    out = args.out or os.path.join(tempfile.gettempdir(), "gf_tf_convergence.json")
    if args.report:
        stem = os.path.join(netem.REPO_ROOT, "benchmarks", "results",
                            datetime.date.today().isoformat() + "-convergence")
        out = args.out or stem + ".json"
        with open(stem + ".md", "w") as f:
            f.write(f"# Time to accuracy ({meta['date_utc']})\n\n`{command}` on {meta['cpu']} "
                    f"x{meta['logical_cpus']}, TF {meta['tensorflow']}, commit {meta['git_commit']}, "
                    f"wall {meta['wall_seconds'] / 60:.1f} min; load average at start "
                    f"{meta['load_average_at_start'][0]:.1f}, at end {meta['load_average_at_end'][0]:.1f}.\n\n"
                    f"{parts}{text}")
        print(f"report: {stem}.md")
    report.write_json(out, payload)
    print(f"JSON: {out}")
    plt = harness.pyplot() if args.plots else None
    if args.plots and plt is None:
        print(f"figures: {harness.PLOT_MISSING}")
    elif args.plots:
        from benchmarks import plots   # pylint: disable=import-outside-toplevel
        for path in plots.convergence_figures([out], plots.DEFAULT_OUT_DIR, plt):
            print(f"figure: {path}")
    failed = [r for r in results if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
