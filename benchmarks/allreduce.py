"""All-reduce benchmark on an emulated network: GradientFlow vs TensorFlow's default vs the ring bound.

    sudo python -m benchmarks.allreduce --quick                  # smoke test, < 2 min
    sudo python -m benchmarks.allreduce --preset targets --out benchmarks/results/allreduce.json
    sudo python -m benchmarks.allreduce --preset scale --out benchmarks/calibration/allreduce.json
    sudo python -m benchmarks.allreduce --sets resnet50 --workers 2 --rates 100,1000,none \
        --methods tf_fp32,gf_fp16,csc_1

For every cell (gradient set x workers N x link rate x method) N worker
processes run in their own network namespaces (benchmarks/netem.py) and
all-reduce a gradient list shaped like the named network
(benchmarks/workers/gradients.py). Reported per cell:

- s/all-reduce: worker 0's median wall time over the timed iterations
  (after warm-up iterations that trace the function and build the plan).
- wire MB/worker: bytes each worker's eth0 transmitted per all-reduce, read
  from the namespace's interface counters (TCP/IP and gRPC framing included).
- bound s: the ring lower bound 2(N-1)/N * payload / goodput, where payload
  is the bytes the method must put into collectives per worker (fp32: 4 B x
  elements; fp16: 2 B x elements; CSC: the bytes GradientFlow's CommStats
  report, i.e. selected chunks in fp16 plus the fp32 chunk norms) and goodput
  is the TCP payload rate measured in the same run around the ring
  (EmulatedCluster.measure_goodput: all links at once, best link).
- x bound: measured / bound; speedup: TF default fp32 time / this time.
- paired vs TF (default only): after the all-reduce loop, the same worker
  processes call the set's all-reduce and TF's own (ReplicaContext.all_reduce
  of a copy of the set, which GradientFlow passes through) in turn; TF's
  median / ours. Both halves share the processes, their placement on the
  cores and the moment, which the separate launches of the speedup column do
  not (ResNet-20 at N = 3-4 moved up to 40% between launches of one method);
  with --launches K, the median over the launches.
- chunk path s (CSC only): the same worker processes time CSC's local path
  (accumulate, norms, top-k, gather, scatter, residual update) with every
  collective replaced by the identity, after the all-reduce loop. CSC's
  limit is the larger of its ring bound and its chunk path; x limit:
  measured / limit.
- pack+unpack % (gf_fp16 only): gf_tf.ops pack+unpack of the same list timed
  alone in the same worker processes right after the all-reduce loop, as a
  share of the all-reduce time (an upper bound: in the step, packs overlap
  the collectives of other packs).
- with --profile (GradientFlow methods): one extra step of worker 0 under the
  TF profiler. "GF ops exposed %": time gf_tf's ops (GfPack, GfUnpack,
  GfAccumulate, GfGatherChunks, GfScatterChunks) ran while no collective was
  in flight on that worker, as a share of the step; "collectives": collective
  ops issued per step. The op summary is in the JSON.
- plan (GradientFlow methods): how the set's gradients travelled
  (`GradientFlowAllReduce.plans()`: method, pack size, algorithm, the
  planner's predicted seconds) and the planner's measured constants
  (`GradientFlowAllReduce.costs`: hop, round, byte, copy, FP16 seconds; None
  when every setting is pinned), in the JSON cell and printed below the table.

Presets: quick (smoke test), targets (the CSC speed targets), full (every method
x set x N in 2-4 x rate), scale (N up to 8, gf_tf's default `default`
and the recursive-doubling methods; the calibration of benchmarks.projection).

Needs root; without it, exits with status 2 and changes nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from benchmarks import netem, report
from benchmarks.workers import gradients, methods

BASE_PORT = 23000
DEFAULT_RATES = [100.0, 1000.0, None]
ALL_SETS = list(gradients.GRADIENT_SETS)

Launch = Tuple[int, Optional[float], str, List[str]]   # (num_workers, rate_mbit, method, sets)


def parse_rates(text: str) -> List[Optional[float]]:
    rates = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("none", "unshaped", "0"):
            rates.append(None)
        else:
            try:
                rates.append(float(item))
            except ValueError:
                raise SystemExit(f"--rates: {item!r} is not a number of Mbit/s or 'none'")
    return rates


def parse_list(text: str, valid: List[str], flag: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in valid]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {valid}")
    return items


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
        return sorted(launches, key=lambda l: (l[0], l[1] is None, l[1] or 0))
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
    return sorted(launches, key=lambda l: (l[0], l[1] is None, l[1] or 0))


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


def unavailable_methods() -> Dict[str, str]:
    """Methods whose gf_tf API is not importable yet, with the reason (the others are being written)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import gf_tf\n"
                               "print('dense', hasattr(gf_tf, 'GradientFlowAllReduce') and "
                               "hasattr(gf_tf, 'MultiWorkerMirroredStrategy'))\n"
                               "print('csc', hasattr(gf_tf, 'ChunkSparsity'))"],
        capture_output=True, text=True, cwd=netem.REPO_ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
        return {m: f"import gf_tf failed: {why}" for m in methods.METHODS if methods.is_gradient_flow(m)}
    found = dict(line.split() for line in probe.stdout.splitlines())
    missing = {}
    for m in methods.METHODS:
        if methods.is_gradient_flow(m) and not methods.is_csc(m) and found.get("dense") != "True":
            missing[m] = "gf_tf.GradientFlowAllReduce / MultiWorkerMirroredStrategy not exported"
        if methods.is_csc(m) and found.get("csc") != "True":
            missing[m] = "gf_tf.ChunkSparsity not exported"
    return missing


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
    if methods.is_csc(method):
        argv.append("--chunk-path")
    if profile and methods.is_gradient_flow(method):
        argv += ["--profile", os.path.join(log_dir, f"profile_{method}_n{n}_{rate}")]
    job = cluster.run_job([argv] * n, port, timeout=120 + 4 * budget, log_dir=log_dir,
                          tag=f"{method}_n{n}_{report.link_label(rate).replace(' ', '').replace('/', '')}")
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
        if "chunk_path_s" in chief:
            cell["chunk_path_s"] = statistics.median(w["chunk_path_s"] for w in per_worker)
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


def results_table(cells: List[Dict]) -> str:
    headers = ["gradients", "N", "link", "method", "s/all-reduce", "wire MB/worker", "wire/ideal",
               "bound s", "x bound", "chunk path s", "x limit", "speedup vs TF fp32", "paired vs TF",
               "bottleneck", "pack+unpack %", "GF ops exposed %",
               "collectives", "plan", "check"]
    rows = []
    order = {m: i for i, m in enumerate(methods.METHODS)}
    for c in sorted(cells, key=lambda c: (ALL_SETS.index(c["set"]), c["workers"],
                                          c["rate_mbit"] is None, c["rate_mbit"] or 0, order[c["method"]])):
        gradients_label = f"{c['set']} ({c['elements'] / 1e6:.2f}M)"
        if "error" in c:
            rows.append([gradients_label, c["workers"], report.link_label(c["rate_mbit"]), c["method"],
                         "FAILED", None, None, None, None, None, None, None, None, None, None, None,
                         None, None, c["error"][:80]])
            continue
        check = (f"err {c['max_rel_error']:.1e}" if "max_rel_error" in c else
                 f"nnz {100 * c['nonzero_fraction']:.2g}%" if "nonzero_fraction" in c else "")
        rows.append([gradients_label, c["workers"], report.link_label(c["rate_mbit"]), c["method"],
                     c["median_s"], c["wire_tx_bytes_per_worker"] / 1e6, c["wire_over_ideal"], c["bound_s"],
                     c["ratio_to_bound"], c.get("chunk_path_s"), c.get("ratio_to_limit"),
                     c.get("speedup_vs_tf_fp32"), c.get("paired_speedup"), c.get("bottleneck"),
                     100 * c["pack_unpack_share"] if "pack_unpack_share" in c else None,
                     100 * c["gf_ops_exposed_share"] if "gf_ops_exposed_share" in c else None,
                     c["profile"]["collective_ops"] if "profile" in c else None,
                     short_plan(c.get("plans")), check])
    return report.markdown_table(headers, rows)


def short_plan(plans: Optional[List[Dict]]) -> Optional[str]:
    """A table cell for the recorded plans of a set: "tf", "fp16 ring 4MiB", "fp16 rd 1 pack"."""
    if not plans:
        return None
    labels = []
    for plan in plans:
        if plan["method"] == "tf":
            labels.append("tf")
            continue
        pack = plan["bytes_per_pack"]
        size = "1 pack" if not pack else (f"{pack / 2 ** 20:g}MiB" if pack >= 2 ** 20 else f"{pack}B")
        algorithm = "rd" if plan["algorithm"] == "recursive_doubling" else plan["algorithm"]
        labels.append(f"{plan['method']} {algorithm} {size}")
    return "; ".join(labels)


def plans_report(cells: List[Dict]) -> str:
    """One line per GradientFlow cell: the plan each set travelled by and the measured costs."""
    lines = []
    for c in cells:
        if "plans" not in c:
            continue
        where = f"{c['set']}, N={c['workers']}, {report.link_label(c['rate_mbit'])}, {c['method']}"
        plans = "; ".join(p["describe"] for p in c["plans"]) or "no plan recorded"
        costs = c.get("costs")
        measured = ("settings pinned, nothing measured" if costs is None else
                    f"measured {1e3 * costs[0]:.3f} ms/hop, {1e3 * costs[1]:.3f} ms/round, "
                    f"{8e-9 / max(costs[2], 1e-15):.2f} Gbit/s, local {1e9 * costs[3]:.2f} / "
                    f"{1e9 * costs[4]:.2f} ns/element")
        lines.append(f"- {where}: {plans} ({measured})")
    return "\n".join(lines)


def scale_targets_table(cells: List[Dict]) -> str:
    """The default's all-reduce targets: the default >= 0.95x TF fp32 on every cell measured;
    CSC 1% over recursive doubling >= 1.5x CSC 1% on the ring (ResNet-20, N = 8, 1 Gbit/s)."""
    timed = {(c["set"], c["workers"], c["rate_mbit"], c["method"]): c["median_s"]
             for c in cells if "median_s" in c}
    rows = []
    for (set_, n, rate, method), seconds in sorted(timed.items(), key=lambda kv: (
            ALL_SETS.index(kv[0][0]), kv[0][1], kv[0][2] is None, kv[0][2] or 0)):
        where = f"{set_}, N={n}, {report.link_label(rate)}"
        base = timed.get((set_, n, rate, "tf_fp32"))
        if method == "default" and base:
            speed = base / seconds
            rows.append([where, "default >= 0.95x TF fp32", f"{speed:.2f}x",
                         "met" if speed >= 0.95 else "MISSED"])
        ring = timed.get((set_, n, rate, "csc_1"))
        if method == "csc_1_rd" and ring:
            speed = ring / seconds
            target = (set_, n, rate) == ("resnet20", 8, 1000.0)
            rows.append([where, "CSC 1% recursive doubling vs ring" + (" >= 1.5x" if target else ""),
                         f"{speed:.2f}x", ("met" if speed >= 1.5 else "MISSED") if target else "-"])
    return report.markdown_table(["where", "target", "measured", "verdict"], rows)


# The CSC targets: (N, Mbit/s) -> CSC 1% speedup over TF fp32 at least this.
CSC_SPEEDUP_TARGETS = {(2, 100.0): 120.0, (2, 1000.0): 40.0, (4, 100.0): 100.0, (4, 1000.0): 15.0}


def targets_table(cells: List[Dict]) -> str:
    def find(set_, n, rate, method):
        for c in cells:
            if (c["set"], c["workers"], c["rate_mbit"], c["method"]) == (set_, n, rate, method) and "median_s" in c:
                return c
        return None

    rows = []
    for n in (2, 4):
        for rate in (100.0, 1000.0):
            where = f"ResNet-50, N={n}, {report.link_label(rate)}"
            gf = find("resnet50", n, rate, "gf_fp16")
            if gf is None:
                rows.append([where, "GF fp16 within 1.1x of its ring bound", "not measured", "-"])
            else:
                rows.append([where, "GF fp16 within 1.1x of its ring bound", f"{gf['ratio_to_bound']:.2f}x",
                             _verdict(gf["ratio_to_bound"] <= 1.1, gf)])
            csc = find("resnet50", n, rate, "csc_1")
            if csc is None:
                rows.append([where, "CSC 1% measured", "not measured", "-"])
                continue
            if "ratio_to_limit" in csc:
                rows.append([where, "CSC 1% within 2x of its limit (max of ring bound, chunk path)",
                             f"{csc['ratio_to_limit']:.2f}x (bound {csc['bound_s']:.3f} s, "
                             f"chunk path {csc['chunk_path_s']:.3f} s)", _verdict(csc["ratio_to_limit"] <= 2.0, csc)])
            target = CSC_SPEEDUP_TARGETS[(n, rate)]
            speed = csc.get("speedup_vs_tf_fp32")
            rows.append([where, f"CSC 1% >= {target:g}x faster than TF fp32",
                         f"{speed:.1f}x" if speed else "-", _verdict(speed is not None and speed >= target, csc)])
    for c in cells:
        if c["method"] == "gf_fp16" and c["rate_mbit"] == 1000.0 and "pack_unpack_share" in c \
                and c["set"] != "resnet20":
            where = f"{c['set']}, N={c['workers']}, 1 Gbit/s"
            rows.append([where, "pack+unpack < 5% of all-reduce (timed alone)",
                         f"{100 * c['pack_unpack_share']:.1f}%", "met" if c["pack_unpack_share"] < 0.05 else "MISSED"])
            if "gf_ops_exposed_share" in c:
                rows.append([where, "pack+unpack < 5% of all-reduce (profiled step, not overlapping a collective)",
                             f"{100 * c['gf_ops_exposed_share']:.1f}% (busy {100 * c['gf_ops_busy_share']:.1f}%)",
                             "met" if c["gf_ops_exposed_share"] < 0.05 else "MISSED"])
    return report.markdown_table(["where", "target", "measured", "verdict"], rows)


def _verdict(ok: bool, cell: Dict) -> str:
    suffix = f" ({cell['bottleneck']}-bound)" if cell.get("bottleneck") else ""
    return ("met" if ok else "MISSED") + suffix


def plot(cells: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install '.[plot]'); plot skipped"
    groups = sorted({(c["set"], c["workers"]) for c in cells if "median_s" in c},
                    key=lambda g: (ALL_SETS.index(g[0]), g[1]))
    if not groups:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
    for ax, (set_, n) in zip(axes[0], groups):
        for i, method in enumerate(methods.METHODS):
            pts = sorted((c["goodput_bps"] / 1e6, c["median_s"], c["bound_s"]) for c in cells
                         if (c["set"], c["workers"], c["method"]) == (set_, n, method) and "median_s" in c)
            if not pts:
                continue
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=methods.LABELS[method])
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=color)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured goodput per link, Mbit/s (rightmost: unshaped)")
        ax.set_ylabel("seconds per all-reduce")
        ax.set_title(f"{set_}, N={n} (dotted: ring bound)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    report.save_figure(fig, path, dpi=110)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: resnet20, N=2, 100 Mbit/s, 2 iterations")
    parser.add_argument("--preset", default=None, help="quick | targets | full (default: full unless lists given)")
    parser.add_argument("--sets", help=f"comma-separated subset of {ALL_SETS}")
    parser.add_argument("--workers", help="comma-separated N, e.g. 2,4")
    parser.add_argument("--rates", help="comma-separated Mbit/s or 'none' for unshaped, e.g. 100,1000,none")
    parser.add_argument("--methods", help=f"comma-separated subset of {methods.METHODS} (auto: default)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5; quick: 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--goodput-seconds", type=float, default=3.0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/allreduce.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra step per cell (worker 0's op summary goes into the JSON)")
    parser.add_argument("--launches", type=int, default=1,
                        help="launch every cell K times, interleaved with the other methods of its "
                             "N and link; a cell is the launch with the median median (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the matrix and its time estimate only")
    args = parser.parse_args(argv)

    custom = any([args.sets, args.workers, args.rates]) or (args.methods and not (args.quick or args.preset))
    preset = "quick" if args.quick else (args.preset or ("custom" if custom else "full"))
    if preset == "custom":
        sets = parse_list(args.sets, ALL_SETS, "--sets") if args.sets else ALL_SETS
        meths = (methods.parse(args.methods) if args.methods
                 else methods.PRESET_METHODS)
        ns = [int(x) for x in args.workers.split(",")] if args.workers else [2, 3, 4]
        rates = parse_rates(args.rates) if args.rates else DEFAULT_RATES
        launches = [(n, r, m, sets) for n in ns for r in rates for m in meths]
    else:
        launches = preset_launches(preset)
        if args.methods:   # a preset can still be narrowed to some methods
            keep = methods.parse(args.methods)
            launches = [l for l in launches if l[2] in keep]
    iters = args.iters if args.iters is not None else (2 if preset == "quick" else 5)
    if iters < 1 or args.launches < 1:
        raise SystemExit("--iters and --launches must be >= 1")
    launches = launches * args.launches   # run_launches interleaves the repeats per (N, rate)
    estimate = estimate_matrix_seconds(launches, iters, args.warmup, args.goodput_seconds)
    print(f"matrix '{preset}': {len(launches)} launches, estimated {estimate / 60:.1f} min "
          f"(rough, 2-core machine)", flush=True)
    if args.dry_run:
        for l in launches:
            print(f"  N={l[0]} {report.link_label(l[1])} {l[2]} {','.join(l[3])}: "
                  f"~{estimate_launch_seconds(l, iters, args.warmup):.0f}s")
        return 0
    netem.require_root()

    out_path = args.out or os.path.join(netem.REPO_ROOT, "benchmarks", "results", "allreduce.json")
    plot_path = args.plot or os.path.splitext(out_path)[0] + ".png"
    missing = unavailable_methods()
    for m, why in missing.items():
        if any(l[2] == m for l in launches):
            print(f"{m} skipped: {why}", flush=True)
    launches = [l for l in launches if l[2] not in missing]
    command = "python -m benchmarks.allreduce " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = report.machine_description(command)
    meta.update({"iters": iters, "warmup": args.warmup, "preset": preset, "skipped_methods": missing,
                 "launches_per_cell": args.launches})
    cells: List[Dict] = []
    goodputs: List[Dict] = []
    log_dir = tempfile.mkdtemp(prefix="gf_allreduce_logs_")
    started = time.time()
    port = BASE_PORT
    for n in sorted({l[0] for l in launches}):
        with netem.EmulatedCluster(n) as cluster:
            for rate in sorted({l[1] for l in launches if l[0] == n}, key=lambda r: (r is None, r or 0)):
                cluster.set_rate(rate)
                gp = cluster.measure_goodput(seconds=args.goodput_seconds)
                goodput = max(gp["per_link_bps"])
                goodputs.append({"workers": n, "rate_mbit": rate, **gp, "used_bps": goodput})
                print(f"N={n} {report.link_label(rate)}: goodput {goodput / 1e6:.1f} Mbit/s "
                      f"(links: {', '.join(f'{b / 1e6:.1f}' for b in gp['per_link_bps'])})", flush=True)
                for launch in [l for l in launches if l[0] == n and l[1] == rate]:
                    port += 1
                    t0 = time.time()
                    outcome = run_launch(cluster, launch, port, iters, args.warmup, log_dir, args.profile)
                    new = derive_cells(launch, outcome, goodput)
                    for c in new:   # other jobs on the machine distort CPU-bound cells: keep a record
                        c["load_average_1min"] = os.getloadavg()[0]
                    cells += new
                    summary = ", ".join(f"{c['set']} {c['median_s']:.3f}s" if "median_s" in c else
                                        f"{c['set']} FAILED" for c in new)
                    print(f"  {launch[2]:8s} {summary}  [{time.time() - t0:.0f}s]"
                          + (f"  error: {outcome['error']}" if outcome["error"] else ""), flush=True)
                    report.write_json(out_path, {"meta": meta, "goodput": goodputs, "cells": cells})
    cells = merge_launches(cells)
    add_speedups(cells)
    meta["wall_seconds"] = time.time() - started
    meta["worker_logs"] = log_dir
    report.write_json(out_path, {"meta": meta, "goodput": goodputs, "cells": cells})
    plot_note = plot(cells, plot_path)
    print(f"\nJSON: {out_path}")
    print(f"plot: {plot_note}" if plot_note else f"plot: {plot_path}")
    print(f"worker logs: {log_dir}")
    print(f"\nAll-reduce benchmark, {meta['date_utc']}, {meta['cpu']} x{meta['logical_cpus']}, "
          f"TF {meta['tensorflow']}, {iters} timed iterations after {args.warmup} warm-up, "
          f"wall {meta['wall_seconds'] / 60:.1f} min\n")
    loads = [c["load_average_1min"] for c in cells if "load_average_1min" in c]
    if loads:
        print(f"1-min load average of the machine (2 cores) at the end of each cell: "
              f"{min(loads):.1f} to {max(loads):.1f}; other jobs slow the CPU-bound cells\n")
    if preset == "scale":
        print(scale_targets_table(cells) + "\n")
    elif any(c["set"] == "resnet50" for c in cells) and preset != "quick":
        print(targets_table(cells) + "\n")
    plans = plans_report(cells)
    if plans:
        print("Plans (worker 0; the same on every worker):\n" + plans + "\n")
    print(results_table(cells))
    failed = [c for c in cells if "error" in c]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
