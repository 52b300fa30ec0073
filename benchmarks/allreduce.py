"""All-reduce benchmark on an emulated network: GradientFlow vs TensorFlow's default vs the ring bound.

    sudo python -m benchmarks.allreduce --quick                  # smoke test, < 2 min
    sudo python -m benchmarks.allreduce --preset targets --out benchmarks/results/allreduce.json
    sudo python -m benchmarks.allreduce --preset scale --out benchmarks/calibration/allreduce.json
    sudo python -m benchmarks.allreduce --sets resnet50 --workers 2 --rates 100,1000,none \
        --methods tf_fp32,gf_fp16,csc_1

Per cell (gradient set x N x link x method), N workers in their own network namespaces all-reduce a
gradient list shaped like the named network. Presets: quick, targets, full, scale. The columns:
docs/benchmarks.md, "Reading the figures"; more in docs/benchmarks.md, "The tools in detail". Needs
root; without it, exits with status 2.
"""

import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from benchmarks import allreduce_tables as tables
from benchmarks import harness, netem, report
from benchmarks.workers import gradients, methods

DEFAULT_RATES = [100.0, 1000.0, None]
ALL_SETS = list(gradients.GRADIENT_SETS)

Launch = Tuple[int, Optional[float], str, List[str]]   # (num_workers, rate_mbit, method, sets)


def preset_launches(name: str) -> List[Launch]:
    """The matrices. `targets` covers every issue target within ~30-40 min on 2 cores."""
    launches: List[Launch] = []
    if name == "quick":
        return [(2, 100.0, m, ["resnet20"]) for m in ("tf_fp32", "gf_fp16", "csc_1", "default")]
    if name == "targets":
        # Budgeted for ~20-25 min on 2 cores; covers every all-reduce target of the issue.
        for rate in DEFAULT_RATES:
            for m in methods.PRESET_METHODS:                            # N=2: everything but
                sets = ["resnet20", "resnet50"]                         # AlexNet at 100 Mbit/s
                if rate is None or rate >= 1000:                         # (25 s per fp32 all-reduce)
                    if m in ("tf_fp32", "gf_fp16", "csc_1"):
                        sets.append("alexnet")
                launches.append((2, rate, m, sets))
            for m in ("tf_fp32", "tf_fp16", "gf_fp16", "csc_1"):      # N=4: the target cells
                launches.append((4, rate, m, ["resnet20", "resnet50"]))
        for m in ("tf_fp32", "gf_fp16", "csc_1"):                     # N=3: CPU-bound at 1 Gbit/s
            launches.append((3, 1000.0, m, ["resnet50"]))
        return sorted(launches, key=lambda l: (l[0], *harness.link_order(l[1])))
    if name == "full":
        for n in (2, 3, 4):
            for rate in DEFAULT_RATES:
                for m in methods.PRESET_METHODS:
                    launches.append((n, rate, m, list(ALL_SETS)))
        return launches
    if name == "scale":
        return scale_launches()
    raise SystemExit(f"--preset: unknown {name!r}; choose quick, targets, full or scale")


SCALE_METHODS = ["tf_fp32", "gf_fp16", "csc_1", "default"]
SCALE_RD_METHODS = ["gf_fp16_rd", "csc_1_rd"]


def scale_launches() -> List[Launch]:
    """The scale matrix: gf_tf's default against TF fp32 from 2 to 8 workers.

    - {tiny, resnet20, resnet50} x {100 Mbit/s, 1 Gbit/s, unshaped} x N in {2, 3, 4}
      for tf_fp32, gf_fp16, csc_1, default (ResNet-50 only up to N = 4: 2 cores);
    - the recursive-doubling methods at N in {2, 3, 4}, 1 Gbit/s, on tiny and ResNet-20,
      so that benchmarks.projection can fit their round latency on N <= 4 and
      validate it at N = 6 and 8;
    - tiny and ResNet-20 at N in {6, 8}, 1 Gbit/s, for every method above.
    tiny costs milliseconds per iteration; it rides in the same worker processes.
    """
    launches: List[Launch] = []
    for n in (2, 3, 4):
        for rate in DEFAULT_RATES:
            launches += [(n, rate, m, ["tiny", "resnet20", "resnet50"]) for m in SCALE_METHODS]
        launches += [(n, 1000.0, m, ["tiny", "resnet20"]) for m in SCALE_RD_METHODS]
    for n in (6, 8):
        launches += [(n, 1000.0, m, ["tiny", "resnet20"]) for m in SCALE_METHODS + SCALE_RD_METHODS]
    return sorted(launches, key=lambda l: (l[0], *harness.link_order(l[1])))


def estimate_iter_seconds(method: str, set_name: str, n: int, rate_mbit: Optional[float]) -> float:
    """Rough model for time budgets and timeouts: link time of the method's payload bytes
    (`methods.payload_bytes`) + a CPU floor seen on this machine."""
    rate_bps = (rate_mbit or 8000.0) * 1e6 * 0.95
    shapes = gradients.GRADIENT_SETS[set_name]
    link = 2 * (n - 1) / n * methods.payload_bytes(method, shapes) * 8 / rate_bps
    cpu = 1.9e-8 * gradients.num_elements(shapes) * n
    return link + cpu + 0.05


def estimate_launch_seconds(launch: Launch, iters: int, warmup: int) -> float:
    n, rate, method, sets = launch
    per_iter = sum(estimate_iter_seconds(method, s, n, rate) for s in sets)
    return 8.0 + 1.5 * n + (iters + warmup + 1) * per_iter


def estimate_matrix_seconds(launches: List[Launch], iters: int, warmup: int,
                            goodput_seconds: float) -> float:
    """Every launch's estimate, plus a goodput measurement (and ~2 s of netem setup) per (N, rate)."""
    configurations = {(l[0], l[1]) for l in launches}
    return (sum(estimate_launch_seconds(l, iters, warmup) for l in launches)
            + len(configurations) * (goodput_seconds + 2.0))


def run_launch(cluster: netem.EmulatedCluster, launch: Launch, port: int, iters: int, warmup: int,
               log_dir: str, profile: bool = False) -> Dict:
    """Runs one method on one cluster configuration; returns worker results or an error."""
    n, rate, method, sets = launch
    budget = estimate_launch_seconds(launch, iters, warmup)
    per_iter_max = max(estimate_iter_seconds(method, s, n, rate) for s in sets)
    collective_timeout = max(60.0, 6 * per_iter_max + 30)
    argv = [sys.executable, "-m", "benchmarks.workers.allreduce_worker", "--method", method,
            "--sets", ",".join(sets), "--iters", str(iters), "--warmup", str(warmup),
            "--timeout", str(collective_timeout)]
    if method == "gf_fp16":
        argv.append("--pack-overhead")
    if method == "default":
        argv.append("--paired")
    if methods.is_gradient_flow(method):
        argv.append("--local-path")
    if profile and methods.is_gradient_flow(method):
        argv += ["--profile", os.path.join(log_dir, f"profile_{method}_n{n}_{rate}")]
    job = harness.run_job(cluster, [argv] * n, port, timeout=120 + 4 * budget, log_dir=log_dir,
                          tag=harness.job_tag(method, f"n{n}", report.link_label(rate)))
    return {"error": job["error"], "workers": job["results"]}


def derive_cells(launch: Launch, outcome: Dict, goodput_bps: float) -> List[Dict]:
    n, rate, method, sets = launch
    cells = []
    for name in sets:
        elements = gradients.num_elements(gradients.GRADIENT_SETS[name])
        cell = {"set": name, "workers": n, "rate_mbit": rate, "method": method, "elements": elements,
                "tensors": len(gradients.GRADIENT_SETS[name]), "goodput_bps": goodput_bps}
        if outcome["error"] or len(outcome["workers"]) != n:
            cell["error"] = outcome["error"] or "missing worker results"
            cells.append(cell)
            continue
        per_worker = [w["sets"][name] for w in sorted(outcome["workers"], key=lambda w: w["worker"])]
        chief = per_worker[0]
        if "sent_payload_bytes_per_iter" in chief:
            payload, source = chief["sent_payload_bytes_per_iter"], "GradientFlow CommStats"
        else:
            payload, source = methods.payload_bytes(method, gradients.GRADIENT_SETS[name]), "byte model"
        ring = 2 * (n - 1) / n
        bound = ring * payload * 8 / goodput_bps
        cell.update({
            "median_s": chief["median_s"], "times_s": chief["times_s"], "warmup_s": chief["warmup_s"],
            "median_s_per_worker": [w["median_s"] for w in per_worker],
            "wire_tx_bytes_per_worker": statistics.mean(w["tx_bytes_per_iter"] for w in per_worker),
            "wire_rx_bytes_per_worker": statistics.mean(w["rx_bytes_per_iter"] for w in per_worker),
            "payload_bytes": payload, "payload_source": source,
            "ring_ideal_bytes_per_worker": ring * payload,
            "bound_s": bound, "ratio_to_bound": chief["median_s"] / bound,
        })
        cell["wire_over_ideal"] = cell["wire_tx_bytes_per_worker"] / cell["ring_ideal_bytes_per_worker"]
        for key in ("gradient_flow", "ops_library", "costs"):
            if key in outcome["workers"][0]:
                cell[key] = outcome["workers"][0][key]
        for key in ("max_rel_error", "nonzero_fraction", "stats_steps_per_iter", "plans"):
            if key in chief:
                cell[key] = chief[key]
        if "profile" in chief:
            prof = chief["profile"]
            cell["profile"] = prof
            cell["gf_ops_busy_share"] = prof["gf_busy_s"] / prof["wall_s"]
            cell["gf_ops_exposed_share"] = prof["gf_exposed_s"] / prof["wall_s"]
        if "paired_s" in chief:
            cell["paired_s"], cell["paired_tf_s"] = chief["paired_s"], chief["paired_tf_s"]
            cell["paired_speedup"] = chief["paired_tf_s"] / chief["paired_s"]
        if "pack_unpack_s" in chief:
            cell["pack_unpack_s"] = statistics.median(w["pack_unpack_s"] for w in per_worker)
            cell["pack_unpack_share"] = cell["pack_unpack_s"] / chief["median_s"]
        if "local_path_s" in chief:   # encode + decode: everything but the collectives
            cell["cpu_s"] = statistics.median(w["local_path_s"] for w in per_worker)
        if "cpu_s" in cell and methods.is_csc(method):   # CSC's local work is its chunk path
            cell["chunk_path_s"] = cell["cpu_s"]
            cell["limit_s"] = max(bound, cell["chunk_path_s"])
            cell["ratio_to_limit"] = chief["median_s"] / cell["limit_s"]
        cells.append(cell)
    return cells


def merge_launches(cells: List[Dict]) -> List[Dict]:
    """One cell per (set, N, rate, method) from repeated launches (`--launches K`).

    The merged cell is the launch whose median is the median of the launch medians (for
    an even K, the lower middle one), with `launch_medians_s` (every launch's median, in
    launch order) and `launch_spread` ((max - min) / median over the launches) added. A
    failed launch is kept as a cell with "error" only when every launch of it failed.
    """
    groups: Dict[Tuple, List[Dict]] = {}
    for c in cells:
        groups.setdefault((c["set"], c["workers"], c["rate_mbit"], c["method"]), []).append(c)
    merged = []
    for group in groups.values():
        timed = [c for c in group if "median_s" in c]
        if not timed:
            merged.append(group[0])
            continue
        medians = [c["median_s"] for c in timed]
        middle = sorted(timed, key=lambda c: c["median_s"])[(len(timed) - 1) // 2]
        cell = dict(middle, launch_medians_s=medians,
                    launch_spread=(max(medians) - min(medians)) / middle["median_s"])
        paired = [c["paired_speedup"] for c in timed if "paired_speedup" in c]
        if paired:   # the median over the launches, each paired within its own processes
            cell.update(paired_speedups=paired, paired_speedup=statistics.median(paired))
        merged.append(cell)
    return merged


def add_speedups(cells: List[Dict]) -> None:
    base = {(c["set"], c["workers"], c["rate_mbit"]): c["median_s"]
            for c in cells if c["method"] == "tf_fp32" and "median_s" in c}
    for c in cells:
        b = base.get((c["set"], c["workers"], c["rate_mbit"]))
        if b and "median_s" in c:
            c["speedup_vs_tf_fp32"] = b / c["median_s"]
    # Link- or CPU-bound: the link is the bottleneck when the method's bound at this rate
    # exceeds what the same method takes unshaped (its CPU cost).
    unshaped = {(c["set"], c["workers"], c["method"]): c["median_s"]
                for c in cells if c["rate_mbit"] is None and "median_s" in c}
    for c in cells:
        u = unshaped.get((c["set"], c["workers"], c["method"]))
        if c["rate_mbit"] is not None and u is not None and "bound_s" in c:
            c["bottleneck"] = "link" if c["bound_s"] > u else "CPU"


def main(argv=None) -> int:
    parser = harness.matrix_parser(__doc__, "resnet20, N=2, 100 Mbit/s, 2 iterations",
                                   "quick | targets | full | scale (default: full unless lists given)", "sets",
                                   ALL_SETS, methods.METHODS)
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5; quick: 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/allreduce.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra step per cell (worker 0's op summary goes into the JSON)")
    parser.add_argument("--launches", type=int, default=1,
                        help="launch every cell K times, interleaved with the other methods of its "
                             "N and link; a cell is the launch with the median median (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the matrix and its time estimate only")
    args = parser.parse_args(argv)

    preset = harness.choose_preset(args, ("sets", "workers", "rates"), "full")
    if preset == "custom":
        sets = harness.parse_list(args.sets, ALL_SETS, "--sets") if args.sets else ALL_SETS
        meths = methods.parse(args.methods) if args.methods else methods.PRESET_METHODS
        ns = [int(x) for x in args.workers.split(",")] if args.workers else [2, 3, 4]
        rates = harness.parse_rates(args.rates) if args.rates else DEFAULT_RATES
        launches = [(n, r, m, sets) for n in ns for r in rates for m in meths]
    else:
        launches = preset_launches(preset)
        if args.methods:   # a preset can still be narrowed to some methods
            keep = methods.parse(args.methods)
            launches = [l for l in launches if l[2] in keep]
    iters = args.iters if args.iters is not None else (2 if preset == "quick" else 5)
    if iters < 1 or args.launches < 1:
        raise SystemExit("--iters and --launches must be >= 1")
    launches = launches * args.launches   # the sweep interleaves the repeats per (N, rate)
    estimate = estimate_matrix_seconds(launches, iters, args.warmup, args.goodput_seconds)
    print(f"matrix '{preset}': {len(launches)} launches, estimated {estimate / 60:.1f} min "
          f"(rough, {os.cpu_count()}-core machine)", flush=True)
    if args.dry_run:
        for l in launches:
            print(f"  N={l[0]} {report.link_label(l[1])} {l[2]} {','.join(l[3])}: "
                  f"~{estimate_launch_seconds(l, iters, args.warmup):.0f}s")
        return 0
    netem.require_root()

    out_path = args.out or os.path.join(netem.REPO_ROOT, "benchmarks", "results", "allreduce.json")
    plot_path = args.plot or os.path.splitext(out_path)[0] + ".png"
    launches, meta = harness.start("allreduce", argv, launches, lambda l: l[2])
    meta.update({"iters": iters, "warmup": args.warmup, "preset": preset, "launches_per_cell": args.launches})
    cells: List[Dict] = []
    goodputs: List[Dict] = []
    log_dir = tempfile.mkdtemp(prefix="gf_allreduce_logs_")
    started = time.time()

    def run(cluster, launch, port, goodput):
        outcome = run_launch(cluster, launch, port, iters, args.warmup, log_dir, args.profile)
        new = derive_cells(launch, outcome, goodput)
        for c in new:   # other jobs on the machine distort CPU-bound cells: keep a record
            c["load_average_1min"] = os.getloadavg()[0]
        cells.extend(new)
        report.write_json(out_path, {"meta": meta, "goodput": goodputs, "cells": cells})
        summary = ", ".join(f"{c['set']} {c['median_s']:.3f}s" if "median_s" in c else
                            f"{c['set']} FAILED" for c in new)
        return new, f"{launch[2]:8s} {summary}" + (f"  error: {outcome['error']}" if outcome["error"] else "")

    harness.sweep(launches, lambda l: l[0], lambda l: l[1], run, goodput_seconds=args.goodput_seconds,
                  goodputs=goodputs)
    cells = merge_launches(cells)
    add_speedups(cells)
    meta["wall_seconds"] = time.time() - started
    meta["worker_logs"] = log_dir
    report.write_json(out_path, {"meta": meta, "goodput": goodputs, "cells": cells})
    plot_note = tables.plot(cells, plot_path)
    print(f"\nJSON: {out_path}")
    print(f"plot: {plot_note}" if plot_note else f"plot: {plot_path}")
    print(f"worker logs: {log_dir}")
    print(harness.header("All-reduce benchmark", meta,
                         f"{iters} timed iterations after {args.warmup} warm-up, ", cells))
    if preset == "scale":
        print(tables.scale_targets_table(cells) + "\n")
    elif any(c["set"] == "resnet50" for c in cells) and preset != "quick":
        print(tables.targets_table(cells) + "\n")
    plans = tables.plans_report(cells)
    if plans:
        print("Plans (worker 0; the same on every worker):\n" + plans + "\n")
    print(tables.results_table(cells))
    failed = [c for c in cells if "error" in c]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
