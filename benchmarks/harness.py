"""What the benchmarks' entry points share; allreduce, fit and convergence keep only their cells and tables.

- The frame of an entry point: `matrix_parser` (the flags of a matrix), `choose_preset` (a preset, or the
  lists given), `start` (the command and machine lines, the methods skipped because gf_tf lacks their API)
  and `header` (with the load average); `parse_list`, `parse_rates` and `unavailable_methods`.
- The run loop, `sweep`: cells over N x links, one emulated cluster per N (benchmarks.netem), links in
  `link_order`, ports counted from `BASE_PORT`, one progress line per cell; `job_tag` names a cell's logs.
- The worker supervisor, `run_job`, and the worker result schema: a worker ends with one line
  `RESULT <json>` written by `write_result`, read by `read_result`.
- Figure output: `pyplot`, the one matplotlib guard (benchmarks.report.save_figure writes the PNG).

Why `run_job` is not gf_tf.launch.run_tasks: a benchmark's worker runs inside its own network namespace
(`ip netns exec`: its links are shaped per job), a job has a deadline after which every worker is killed,
the workers of one job may run different commands (benchmarks.fit pins worker i to core i mod cores), and
each worker's output goes to its own log file, whose last `RESULT` line is the worker's figures. run_tasks
starts one command per TF_CONFIG on this host's network, waits without a deadline and streams every line to
one output. Both take TF_CONFIG from gf_tf.cluster.tf_config.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from benchmarks import netem, report
from benchmarks.workers import methods
from gf_tf.cluster import tf_config

BASE_PORT = 23000   # a job's workers listen on BASE_PORT + its number in the run
RESULT_PREFIX = "RESULT "
WorkerResult = Dict[str, Any]   # a worker's figures: JSON-serialisable, keys as its entry point reads them
Cell = TypeVar("Cell")
Outcome = TypeVar("Outcome")


def say(text: str) -> None:
    """Prints a progress line at once (a long run's log is read while it runs)."""
    print(text, flush=True)


def write_result(result: WorkerResult) -> None:
    """Prints a worker's figures as the one line `RESULT <json>` its supervisor reads."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def read_result(output: str) -> Optional[WorkerResult]:
    """The figures of the last `RESULT <json>` line of a worker's stdout; None when it printed none."""
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def link_order(rate_mbit: Optional[float]) -> Tuple[bool, float]:
    """Sort key of links: slowest first, unshaped (None) last."""
    return rate_mbit is None, rate_mbit or 0.0


def job_tag(*parts: object) -> str:
    """A job's name for its log files: the parts joined by "_", without spaces, "/" or "."."""
    return "_".join(map(str, parts)).replace(" ", "").replace("/", "").replace(".", "p")


def parse_rates(text: str) -> List[Optional[float]]:
    """--rates / --links: comma-separated Mbit/s, "none" (or "unshaped", "0") for an unshaped link."""
    rates = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("none", "unshaped", "0"):
            rates.append(None)
            continue
        try:
            rates.append(float(item))
        except ValueError:
            raise SystemExit(f"--rates: {item!r} is not a number of Mbit/s or 'none'") from None
    return rates


def parse_list(text: str, valid: List[str], flag: str) -> List[str]:
    """The comma-separated items of `flag`, each one of `valid`; SystemExit naming the unknown ones."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in valid]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {valid}")
    return items


def unavailable_methods() -> Dict[str, str]:
    """GradientFlow's methods, each with the reason, when gf_tf does not import (probed in a subprocess: no
    TensorFlow in this process); {} when it does. TensorFlow's own methods run either way."""
    probe = subprocess.run([sys.executable, "-c", "import gf_tf"], capture_output=True, text=True,
                           cwd=netem.REPO_ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if probe.returncode == 0:
        return {}
    why = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
    return {m: f"import gf_tf failed: {why}" for m in methods.METHODS if methods.is_gradient_flow(m)}


def matrix_parser(doc: str, quick: str, presets: str, axis: str, axis_choices: Sequence[str],
                  method_choices: Sequence[str]) -> argparse.ArgumentParser:
    """The flags of a matrix over N x links x methods: --quick (`quick` says what it runs), --preset
    (`presets` names them), the lists of a custom matrix (`--<axis>`, --workers, --rates, --methods)
    and --goodput-seconds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {quick}")
    parser.add_argument("--preset", default=None, help=presets)
    parser.add_argument(f"--{axis}", help=f"comma-separated subset of {list(axis_choices)}")
    parser.add_argument("--workers", help="comma-separated N, e.g. 2,4")
    parser.add_argument("--rates", help="comma-separated Mbit/s or 'none' for unshaped, e.g. 100,1000,none")
    parser.add_argument("--methods", help=f"comma-separated subset of {list(method_choices)} (auto: default)")
    parser.add_argument("--goodput-seconds", type=float, default=3.0)
    return parser


def choose_preset(args, lists: Sequence[str], default: str) -> str:
    """"quick" (--quick), the --preset named, "custom" when any of the `lists` flags (or --methods
    without a preset) is given, else `default`."""
    custom = any(getattr(args, name) for name in lists) or (args.methods and not (args.quick or args.preset))
    return "quick" if args.quick else (args.preset or ("custom" if custom else default))


def command_line(module: str, argv: Optional[Sequence[str]]) -> str:
    """The command as typed: `python -m benchmarks.<module> <arguments>`."""
    return f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)


def start(module: str, argv, cells: List[Cell], method_of: Callable[[Cell], str],
          say=say) -> Tuple[List[Cell], Dict[str, Any]]:
    """The cells whose method gf_tf can build (saying which are skipped and why) and the run's meta: the
    machine description, its command line and `skipped_methods`."""
    missing = unavailable_methods()
    for m, why in missing.items():
        if any(method_of(c) == m for c in cells):
            say(f"{m} skipped: {why}")
    meta = report.machine_description(command_line(module, argv))
    meta["skipped_methods"] = missing
    return [c for c in cells if method_of(c) not in missing], meta


def header(title: str, meta: Dict[str, Any], details: str = "", cells: Sequence[Dict] = ()) -> str:
    """The lines above a run's tables: what ran, where, when and for how long; then the range of the
    1-minute load average the cells recorded at their ends (`load_average_1min`), if any did."""
    text = (f"\n{title}, {meta['date_utc']}, {meta['cpu']} x{meta['logical_cpus']}, TF {meta['tensorflow']}, "
            f"{details}wall {meta['wall_seconds'] / 60:.1f} min\n")
    loads = [c["load_average_1min"] for c in cells if "load_average_1min" in c]
    if loads:
        text += (f"\n1-min load average of the machine ({os.cpu_count()} cores) at the end of each cell: "
                 f"{min(loads):.1f} to {max(loads):.1f}; other jobs slow the CPU-bound cells\n")
    return text


def sweep(cells: Sequence[Cell], workers_of: Callable[[Cell], int], rate_of: Callable[[Cell], Optional[float]],
          run: Callable[[Optional[netem.EmulatedCluster], Cell, int, Optional[float]], Tuple[Outcome, str]],
          goodput_seconds: Optional[float] = None, goodputs: Optional[List[Dict]] = None, emulate: bool = True,
          on_cluster: Optional[Callable[[netem.EmulatedCluster], None]] = None, say=say) -> List[Outcome]:
    """Runs every cell, in order of N, then link (`link_order`), then the order given.

    Per N one `netem.EmulatedCluster` (none when `emulate` is False: `run` gets None and runs on this
    host), `on_cluster(cluster)` first; per link the cluster's rate, and with `goodput_seconds` the
    goodput around the ring, measured, printed and appended to `goodputs`. `run(cluster, cell, port,
    goodput_bps)` returns (outcome, progress text); the text is printed with the cell's seconds.
    Returns the outcomes in the order run.
    """
    outcomes: List[Outcome] = []
    port = BASE_PORT
    for n in sorted({workers_of(c) for c in cells}):
        with (netem.EmulatedCluster(n) if emulate else contextlib.nullcontext()) as cluster:
            if cluster is not None and on_cluster is not None:
                on_cluster(cluster)
            for rate in sorted({rate_of(c) for c in cells if workers_of(c) == n}, key=link_order):
                goodput = None
                if cluster is not None:
                    cluster.set_rate(rate)
                if cluster is not None and goodput_seconds is not None:
                    measured = cluster.measure_goodput(seconds=goodput_seconds)
                    goodput = max(measured["per_link_bps"])
                    if goodputs is not None:
                        goodputs.append({"workers": n, "rate_mbit": rate, **measured, "used_bps": goodput})
                    say(f"N={n} {report.link_label(rate)}: goodput {goodput / 1e6:.1f} Mbit/s (links: "
                        f"{', '.join(f'{b / 1e6:.1f}' for b in measured['per_link_bps'])})")
                for cell in [c for c in cells if workers_of(c) == n and rate_of(c) == rate]:
                    port += 1
                    began = time.time()
                    outcome, text = run(cluster, cell, port, goodput)
                    outcomes.append(outcome)
                    say(f"  {text}  [{time.time() - began:.0f}s]")
    return outcomes


def run_job(cluster: netem.EmulatedCluster, argvs: Sequence[Sequence[str]], port: Optional[int],
            timeout: float, log_dir: str, tag: str, hosts: Optional[Sequence[int]] = None) -> Dict[str, object]:
    """Runs argvs[i] in the cluster's host namespace hosts[i] (default: host i) and waits for all of them.

    With `port`, each process gets TF_CONFIG (gf_tf.cluster.tf_config) for a worker cluster of those
    hosts on that port. stdout/stderr go to `log_dir/<tag>_w<i>.{out,err}`. Each process must print one
    `RESULT <json>` line (`write_result`). Returns {"error": None or a message, "results": [figures, ...]};
    when a worker fails, or after `timeout` seconds, every process of the job is killed.
    """
    hosts = list(range(len(argvs))) if hosts is None else list(hosts)
    spec = {"worker": [f"{cluster.addresses[h]}:{port}" for h in hosts]}
    procs, files = [], []
    for i, (host, argv) in enumerate(zip(hosts, argvs)):
        out = open(os.path.join(log_dir, f"{tag}_w{i}.out"), "w+")
        err = open(os.path.join(log_dir, f"{tag}_w{i}.err"), "w+")
        env = {} if port is None else {"TF_CONFIG": tf_config(spec, i)}
        procs.append(cluster.popen(host, argv, env=env, stdout=out, stderr=err))
        files.append((out, err))
    deadline = time.time() + timeout
    error = None
    while error is None and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break   # one worker died: the others would only wait for it until their timeout
        if time.time() > deadline:
            error = f"{tag}: not finished after {timeout:.0f} s (killed)"
        time.sleep(0.2)
    killed = set()
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            killed.add(i)
        p.wait()
    results, failures = [], []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        result = read_result(out.read())
        if p.returncode == 0 and result is not None:
            results.append(result)
        else:
            tail = [line.strip() for line in err.read().splitlines() if line.strip()][-2:]
            how = "killed by the benchmark" if i in killed else f"exited {p.returncode}"
            failures.append((i in killed, f"{tag} worker {i} {how}: " + " | ".join(tail)))
        out.close()
        err.close()
    if error is None and failures:
        error = sorted(failures)[0][1]   # the worker that failed by itself names the cause
    return {"error": error, "results": results}


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (`PLOT_MISSING`)."""
    try:
        import matplotlib   # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt   # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return plt


PLOT_MISSING = "matplotlib is not installed (pip install '.[plot]'); plot skipped"
