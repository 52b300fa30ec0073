r"""A calibrated model of step time, from 2 to 512 workers: `python -m benchmarks.projection`.

    python -m benchmarks.projection                       # the shipped calibration, the 8-512 table
    python -m benchmarks.projection --json out.json       # the same, and its rows as JSON
    python -m benchmarks.projection --fit benchmarks/results/allreduce.json \
        [--validate other.json] [--fit-workers 2,3,4] [--compute-ms alexnet=38.8,resnet50=110]
    python -m benchmarks.projection --fit-json benchmarks/results/fit.json   # measured overlap

With no --fit it reads the calibration shipped with the repository,
benchmarks/calibration/allreduce.json (`sudo python -m benchmarks.allreduce
--preset scale --out benchmarks/calibration/allreduce.json` measures it). A
missing, unreadable or too small file ends with a one-line message saying what
to run, never a traceback.

1. Fit. The all-reduce of one step of method m (TF default fp32, GradientFlow
   FP16, CSC at density d; over TF's ring or recursive doubling) on N workers
   whose links carry B bit/s is modelled as (alpha-beta-gamma model of
   collectives, Thakur, Rabenseifner & Gropp 2005, plus our local costs):

     ring:  T = alpha * 2(N-1) * c_m                  per-hop latency, c_m collectives
              + kappa * 2(N-1)/N * P_m * 8 / B        wire time of P_m payload bytes
              + gamma * (N-1)/N * P_m * s             reduction
     recursive doubling (R = gf_tf.collectives.recursive_doubling.rounds(N) rounds of pairs):
            T = rho * R * c_m                         per-round latency, fitted on its own
              + kappa * R * P_m * 8 / B  +  gamma * R/2 * P_m * s
     both:    + delta_m * E * s                       local work (E elements of the model)

   beta, the seconds per byte on the wire, is 8 / B times kappa (wire bytes over
   payload bytes: TCP/IP and gRPC framing, ideally 1); B is the goodput that
   benchmarks.allreduce measured in the same run. delta_m is the local cost per
   element of the model: TF's own copies (tf_fp32), pack + unpack (gf_fp16*), the
   CSC chunk path (csc_*). s = max(1, N / cores) is the CPU contention of the
   emulation (N worker processes share this machine's cores); it is 1 in the
   projection (a worker per host). rho is not 2 alpha: where worker processes
   share cores a round costs about a whole collective's scheduling (gf_tf.plan.planner);
   without recursive-doubling cells it is taken as 2 alpha (a 2-member ring).
   The seven parameters (alpha, rho, kappa, gamma, delta_tf, delta_gf, delta_csc)
   are fitted by non-negative least squares on relative error.
2. Validate. The model is fitted again on the cells with N in --fit-workers
   (default 2,3,4) only and predicts the others (N = 6 and 8 of the `scale`
   preset); the median and worst |error| are printed. Cells of --validate
   files (runs not fitted on) are predicted by the fit on every cell.
3. Project. Step time = compute + the all-reduce. "default" (gf_tf's default,
   GradientFlowAllReduce() with no arguments) is literally the planner's pick:
   `gf_tf.plan.planner.choose` with `Costs` derived from the fitted parameters
   (`planner_costs`), its predicted seconds the all-reduce. Overlap with
   backprop is OFF by default (--backward-share 0), as in GradientFlowAllReduce
   (overlap=False: one barrier waits for every gradient). `--fit-json F` takes it as measured
   instead: per (model, method) the median `overlap` of F's cells
   (benchmarks.overlap: (compute + all-reduce - step) / the shorter, clamped to
   [0, 1]), so step = compute + all-reduce - overlap x min(compute, all-reduce);
   a (model, method) F does not hold hides nothing.
   The low-rank methods (lowrank_1/2/4, lowrank_2_acp) are projected from their traffic
   (`benchmarks.workers.methods.traffic`: factors, dense remainder and control, 2 or 1
   factor collectives) at FP16 packs' local cost; none of their cells is fitted on (no term prices their matmuls).
   Scaling efficiency = compute / step time; speedup = N x efficiency.

Compute time per step defaults (override with --compute-ms):
  alexnet 38.8 ms: 128 images per GPU at 3,297 images/s. The rate is derived
    from the paper's abstract (arXiv 1902.06855: 95 epochs of ImageNet,
    1,281,167 images, in 1.5 minutes on 512 GPUs at a 410.2x speedup:
    95 * 1281167 / 90 s / 410.2); 128 images per GPU is our assumption.
  resnet50 128 ms: 64 images per GPU on the same GPU, its rate scaled by the
    forward multiply-adds per image (AlexNet 0.72 G, ResNet-50 4.1 G): an
    estimate, not a paper figure.
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import overlap as overlap_lib
from benchmarks import report
from benchmarks.workers import gradients, methods
from gf_tf import collectives
from gf_tf.collectives import recursive_doubling
from gf_tf.plan import DEFAULT_BYTES_PER_PACK, Costs, PlanReport, planner

PARAMETERS = ("alpha", "rho", "kappa", "gamma", "delta_tf", "delta_gf", "delta_csc")
AUTO = "default"   # gf_tf's default: the planner's pick
LOWRANK_METHODS = tuple(m for m in methods.METHODS if methods.get(m).lowrank is not None)
CSC_METHODS = tuple(m for m in methods.METHODS if methods.is_csc(m))
PROJECTED_METHODS = ("tf_fp32", "gf_fp16", "gf_fp16_rd", "csc_1", "csc_1_rd", "csc_1_ahead", "csc_1_ahead_rd",
                     "csc_0.1", *LOWRANK_METHODS, AUTO)
COMPARED_METHODS = ("tf_fp32", "gf_fp16", "csc_1", "csc_1_ahead", "csc_0.1", AUTO)   # alpha matters
MODELLED_METHODS = ("tf_fp32", "gf_fp16", "gf_fp16_rd", *CSC_METHODS)
DEFAULT_CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration",
                                   "allreduce.json")
LOCAL_PARAMETERS = ("gamma", "delta_tf", "delta_gf", "delta_csc")   # scaled by --local-scale
VALIDATION_TARGETS = {"median": 0.15, "worst": 0.35}   # |error| on held-out cells
PAPER_SPEEDUP = {"workers": 512, "link_gbit": 56.0, "model": "alexnet", "speedup": 410.2}
OPEN_SOURCE_SPEEDUP = {"workers": 64, "link_gbit": 56.0, "speedup": 2.5}
DEFAULT_COMPUTE_MS = {"alexnet": 38.8, "resnet50": 128.0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One all-reduce of a gradient set: what the model needs to know about it.

    workers: N. link_bps: ring goodput per link, bit/s. elements: E.
    payload_bytes: P, bytes each worker puts into collectives per step.
    collectives: c, collectives per step. cpu_share: s (>= 1).
    The algorithm is the method's (benchmarks.workers.methods.algorithm).
    """
    method: str
    workers: int
    link_bps: float
    elements: int
    payload_bytes: float
    collectives: int
    cpu_share: float = 1.0


def features(case: Case) -> np.ndarray:
    """The model's regressors, in PARAMETERS order: T = features . parameters (seconds)."""
    n, h = case.workers, case.workers - 1
    if methods.algorithm(case.method) == collectives.RECURSIVE_DOUBLING:
        rounds = recursive_doubling.rounds(n)
        latency, share = [0.0, rounds * case.collectives], float(rounds)
    else:
        latency, share = [2.0 * h * case.collectives, 0.0], 2.0 * h / n
    local = np.zeros(3)
    local[_local_index(case.method)] = case.elements * case.cpu_share
    return np.concatenate([latency, [share * case.payload_bytes * 8.0 / case.link_bps,
                                     share / 2 * case.payload_bytes * case.cpu_share], local])


def all_reduce_seconds(case: Case, params: Dict[str, float]) -> float:
    """Modelled seconds of one step's all-reduce (module docstring, step 1)."""
    return float(features(case) @ np.array([params[p] for p in PARAMETERS]))


def step_seconds(comm_seconds: float, compute_seconds: float, overlapped_share: float) -> float:
    """Step time: compute plus the communication not hidden behind `overlapped_share` of it."""
    return compute_seconds + max(0.0, comm_seconds - overlapped_share * compute_seconds)


def measured_step_seconds(comm_seconds: float, compute_seconds: float, overlap: float) -> float:
    """Step time with a measured overlap fraction (benchmarks.overlap): compute plus
    communication, less `overlap` of the shorter of the two."""
    return compute_seconds + comm_seconds - overlap * min(comm_seconds, compute_seconds)


def _local_index(method: str) -> int:
    """delta_tf, delta_gf or delta_csc. The low-rank methods are priced at delta_gf, their FP16
    packs' work: their matrix products and Gram-Schmidt have no fitted term of their own."""
    if method == "tf_fp32":
        return 0
    if method in ("gf_fp16", "gf_fp16_rd") or method in LOWRANK_METHODS:
        return 1
    if method in CSC_METHODS:
        return 2
    raise ValueError(f"no model for method {method!r}; choose tf_fp32, gf_fp16(_rd), csc_* or "
                     f"lowrank_*")


def fit(cases: Sequence[Case], seconds: Sequence[float]) -> Dict[str, float]:
    """Non-negative least squares on relative error: min sum((T_model / T - 1)^2), parameters >= 0.

    rho without recursive-doubling cases is 2 alpha (a 2-member ring: module docstring).
    Raises ValueError with fewer cases than parameters.
    """
    if len(cases) < len(PARAMETERS):
        raise ValueError(f"need at least {len(PARAMETERS)} measured cells to fit, got {len(cases)}")
    x = np.array([features(c) for c in cases]) / np.array(seconds)[:, None]
    y = np.ones(len(cases))
    free = [j for j in range(len(PARAMETERS)) if x[:, j].any()]
    while True:   # active set: drop the most negative coefficient until all are >= 0
        coef = np.zeros(len(PARAMETERS))
        coef[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        if coef.min() >= 0:
            params = dict(zip(PARAMETERS, coef.tolist()))
            if not x[:, PARAMETERS.index("rho")].any():
                params["rho"] = 2.0 * params["alpha"]
            return params
        free.remove(int(np.argmin(coef)))


def overlapped_share(method: str, backward_share: float) -> float:
    """The share of compute FP16 packs may hide behind (--backward-share, 0 by default:
    overlap is opt-in); TF's default, CSC, the low-rank methods (their factors wait for every
    matrix of the step) and the planner's pick hide nothing."""
    return backward_share if method in ("gf_fp16", "gf_fp16_rd") else 0.0


def planner_costs(params: Dict[str, float], link_bps: float, cpu_share: float = 1.0) -> Costs:
    """The fitted parameters as gf_tf.plan.Costs for links of `link_bps` bit/s.

    The planner's beta carries the wire and the reduction: 2(N-1)/N B beta =
    2(N-1)/N B kappa 8 / link + (N-1)/N B gamma s, so beta = kappa 8 / link + gamma s / 2;
    the latencies are alpha (a ring hop) and rho (a recursive-doubling round); the local
    costs are delta_tf (copy: TF's own, float32 and BF16 packs) and delta_gf (FP16) times s.
    """
    copy_s, fp16_s = params["delta_tf"] * cpu_share, params["delta_gf"] * cpu_share
    return Costs(
        byte_s=params["kappa"] * 8.0 / link_bps + params["gamma"] * cpu_share / 2,
        latency_s={collectives.RING: params["alpha"], collectives.RECURSIVE_DOUBLING: params["rho"]},
        local_s={"none": copy_s, "bf16": copy_s, "fp16": fp16_s})


# -- measured cells -----------------------------------------------------------------------

def modelled_method(cell: Dict) -> Optional[Tuple[str, int]]:
    """(modelled method, bytes per pack) of a measured cell, or None when it has no fixed-traffic model.

    A "default" cell ("auto" in older files) is modelled by the plan it recorded: TF's own
    all-reduce as tf_fp32,
    FP16 packs as gf_fp16 / gf_fp16_rd; float32 or BF16 packs have no model. Low-rank cells
    are not fitted on either: the fit has no term for their matrix products (`_local_index`).
    """
    method = methods.canonical(cell["method"])   # "auto" in files written before the table
    if method == AUTO:
        plans = cell.get("plans") or []
        if len(plans) != 1 or plans[0]["method"] not in ("tf", "fp16"):
            return None
        plan = plans[0]
        if plan["method"] == "tf":
            return "tf_fp32", DEFAULT_BYTES_PER_PACK
        rd = plan["algorithm"] == collectives.RECURSIVE_DOUBLING
        return ("gf_fp16_rd" if rd else "gf_fp16"), int(plan["bytes_per_pack"])
    if method not in MODELLED_METHODS or methods.density(method) == "auto":
        return None   # csc_auto's traffic changes from step to step: not a fixed-traffic sample
    return method, DEFAULT_BYTES_PER_PACK


def measured_cases(path: str, cores: int) -> List[Tuple[Case, float, Dict]]:
    """(case, measured seconds, cell) for every successful, modelled cell of a benchmarks.allreduce JSON."""
    with open(path) as f:
        cells = json.load(f)["cells"]
    out = []
    for cell in cells:
        modelled = modelled_method(cell) if "median_s" in cell else None
        if modelled is None:
            continue
        method, bytes_per_pack = modelled
        payload, collectives = methods.traffic(method, gradients.GRADIENT_SETS[cell["set"]],
                                               bytes_per_pack)
        case = Case(method, cell["workers"], cell["goodput_bps"], cell["elements"],
                    cell.get("payload_bytes", payload), collectives,
                    max(1.0, cell["workers"] / cores))
        out.append((case, cell["median_s"], cell))
    return out


_MEASURE_HINT = ("measure them first: `sudo python -m benchmarks.allreduce --preset scale --out "
                 "benchmarks/calibration/allreduce.json` (about 30 minutes on 2 cores; `--quick` "
                 "is a smoke test of 3 cells, too few to fit)")


def load_cells(paths: Sequence[str], cores: int, need: int = 0) -> List[Tuple[Case, float, Dict]]:
    """The measured cells of every benchmarks.allreduce JSON in `paths`.

    Raises SystemExit with what to run when a file is missing or unreadable, or
    when fewer than `need` usable cells (modelled methods that succeeded) remain.
    """
    cells = []
    for path in paths:
        try:
            cells += measured_cases(path, cores)
        except FileNotFoundError:
            raise SystemExit(f"benchmarks.projection: no measurements at {path}; {_MEASURE_HINT}") from None
        except OSError as e:
            raise SystemExit(f"benchmarks.projection: cannot read {path} ({e.strerror or e}); "
                             f"{_MEASURE_HINT}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:   # JSON errors are ValueErrors
            raise SystemExit(f"benchmarks.projection: {path} is not a benchmarks.allreduce result "
                             f"({type(e).__name__}: {e}); {_MEASURE_HINT}") from None
    if len(cells) < need:
        raise SystemExit(f"benchmarks.projection: {', '.join(paths)} hold {len(cells)} usable cells; "
                         f"fitting the {need} parameters ({', '.join(PARAMETERS)}) needs at least "
                         f"{need}; {_MEASURE_HINT}")
    return cells


def validation_table(params, measured) -> Tuple[str, List[float]]:
    rows, errors = [], []
    for case, seconds, cell in measured:
        predicted = all_reduce_seconds(case, params)
        error = predicted / seconds - 1
        errors.append(error)
        rows.append([cell["set"], case.workers, report.link_label(cell["rate_mbit"]), case.method,
                     seconds, predicted, f"{100 * error:+.1f}%"])
    table = report.markdown_table(["gradients", "N", "link", "method", "measured s", "model s", "error"],
                                  rows)
    return table, errors


def held_out_validation(measured, fit_workers: Sequence[int]) -> Dict:
    """Fits on the cells with N in `fit_workers`, predicts the others.

    Returns {"fit_workers", "held_out_workers", "cells", "median_abs_error",
    "worst_abs_error", "table", "params"}, or {"skipped": why} when either side is too small.
    """
    inside = [m for m in measured if m[0].workers in fit_workers]
    outside = [m for m in measured if m[0].workers not in fit_workers]
    if len(inside) < len(PARAMETERS) or not outside:
        return {"skipped": f"{len(inside)} cells with N in {sorted(fit_workers)} (need "
                           f"{len(PARAMETERS)}) and {len(outside)} held out"}
    params = fit([c for c, _, _ in inside], [t for _, t, _ in inside])
    table, errors = validation_table(params, outside)
    worst = float(np.max(np.abs(errors)))
    return {"fit_workers": sorted(fit_workers),
            "held_out_workers": sorted({c.workers for c, _, _ in outside}), "cells": len(outside),
            "median_abs_error": float(np.median(np.abs(errors))), "worst_abs_error": worst,
            "table": table, "params": params}


# -- projection ---------------------------------------------------------------------------

def project(params, model: str, method: str, workers: int, link_gbit: float, compute_s: float,
            overlap) -> Dict:
    """{"comm_s", "step_s", "efficiency", "speedup"} of `method` ("default": the planner's pick,
    then also "plan", its gf_tf.plan.PlanReport: the plan and its forecast) on `workers`
    one-worker hosts.

    overlap: a float, the share of compute FP16 packs hide behind (--backward-share), or
    {(model, method): measured overlap fraction} (--fit-json; absent: 0)."""
    shapes = gradients.GRADIENT_SETS[model]
    elements = gradients.num_elements(shapes)
    extra = {}
    if method == AUTO:
        plan = PlanReport(*planner.choose(elements, len(shapes), workers,
                                          planner_costs(params, link_gbit * 1e9)))
        comm, extra["plan"] = plan.steady_seconds or 0.0, plan   # a trial keeps the faster
    else:
        payload, collectives = methods.traffic(method, shapes)
        comm = all_reduce_seconds(Case(method, workers, link_gbit * 1e9, elements, payload,
                                       collectives), params)
    if isinstance(overlap, dict):
        step = measured_step_seconds(comm, compute_s, overlap.get((model, method), 0.0))
    else:
        step = step_seconds(comm, compute_s, overlapped_share(method, overlap))
    return {"comm_s": comm, "step_s": step, "efficiency": compute_s / step,
            "speedup": workers * compute_s / step, **extra}


def projection_table(params, compute_ms, worker_counts, links, overlap) -> Tuple[str, List[Dict]]:
    rows, points = [], []
    for model in compute_ms:
        for link in links:
            for method in PROJECTED_METHODS:
                row = [model, f"{link:g} Gbit/s", methods.LABELS[method]]
                for n in worker_counts:
                    p = project(params, model, method, n, link, compute_ms[model] / 1e3, overlap)
                    points.append({"model": model, "link_gbit": link, "method": method, "workers": n, **p})
                    row.append(f"{p['speedup']:.1f}x ({100 * p['efficiency']:.0f}%)")
                rows.append(row)
    headers = ["model", "link", "method"] + [f"N={n}" for n in worker_counts]
    return report.markdown_table(headers, rows), points


def alpha_for_speedup(params, target: float, model: str, method: str, workers: int, link_gbit: float,
                      compute_s: float, overlap) -> Optional[float]:
    """The largest alpha (s per hop) at which `method` still reaches `target` speedup, or None."""
    def speedup(alpha):
        return project({**params, "alpha": alpha}, model, method, workers, link_gbit, compute_s,
                       overlap)["speedup"]
    if speedup(0.0) < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) >= target else (lo, mid)
    return lo


def comparison(params, compute_ms, overlap) -> str:
    n, link, target = PAPER_SPEEDUP["workers"], PAPER_SPEEDUP["link_gbit"], PAPER_SPEEDUP["speedup"]
    compute_s = compute_ms["alexnet"] / 1e3
    lines = [f"Paper: AlexNet, {n} GPUs, {link:g} Gbit/s: {target}x. Open-source systems it beat: "
             f"{OPEN_SOURCE_SPEEDUP['speedup']}x on {OPEN_SOURCE_SPEEDUP['workers']} GPUs."]
    for method in COMPARED_METHODS:
        p = project(params, "alexnet", method, n, link, compute_s, overlap)
        tf64 = project(params, "alexnet", method, OPEN_SOURCE_SPEEDUP["workers"], link, compute_s,
                       overlap)
        alpha = alpha_for_speedup(params, target, "alexnet", method, n, link, compute_s, overlap)
        network_only = {**params, **dict.fromkeys(LOCAL_PARAMETERS, 0.0)}
        free = alpha_for_speedup(network_only, target, "alexnet", method, n, link, compute_s, overlap)
        need = ("unreachable with the fitted local costs even at alpha = 0" if alpha is None
                else f"needs alpha <= {alpha * 1e6:.2f} us per hop")
        need += ("; with free reduction and local work (gamma = delta = 0) " +
                 ("unreachable: the bytes alone cost too much" if free is None
                  else f"alpha <= {free * 1e6:.2f} us per hop"))
        lines.append(f"- {methods.LABELS[method]}: {p['speedup']:.1f}x on {n} "
                     f"({tf64['speedup']:.1f}x on {OPEN_SOURCE_SPEEDUP['workers']}); "
                     f"all-reduce {p['comm_s'] * 1e3:.1f} ms vs compute {compute_s * 1e3:.1f} ms; "
                     f"410.2x {need}")
    return "\n".join(lines)


def plot(points, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install '.[plot]'); plot skipped"
    models = sorted({p["model"] for p in points})
    links = sorted({p["link_gbit"] for p in points})
    fig, axes = plt.subplots(len(models), len(links), figsize=(4 * len(links), 3.6 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for k, method in enumerate(PROJECTED_METHODS):
                pts = sorted((p["workers"], p["speedup"]) for p in points
                             if (p["model"], p["link_gbit"], p["method"]) == (model, link, method))
                ax.plot([a for a, _ in pts], [b for _, b in pts], "o-", color=f"C{k}",
                        label=methods.LABELS[method])
            ns = sorted({p["workers"] for p in points})
            ax.plot(ns, ns, ":", color="gray", label="linear")
            if model == PAPER_SPEEDUP["model"] and link == PAPER_SPEEDUP["link_gbit"]:
                ax.plot([PAPER_SPEEDUP["workers"]], [PAPER_SPEEDUP["speedup"]], "k*", markersize=12,
                        label="paper (410.2x)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{model}, {link:g} Gbit/s")
            ax.set_xlabel("workers")
            ax.set_ylabel("speedup")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    report.save_figure(fig, path, dpi=100)
    return None


def _parse_compute(text: Optional[str]) -> Dict[str, float]:
    compute = dict(DEFAULT_COMPUTE_MS)
    if text:
        for item in text.split(","):
            name, _, value = item.partition("=")
            if name not in compute:
                raise SystemExit(f"--compute-ms: unknown model {name!r}; choose from {list(compute)}")
            try:
                compute[name] = float(value)
            except ValueError:
                raise SystemExit(f"--compute-ms: {item!r} is not model=milliseconds")
    return compute


def _overlap_setting(backward_share: float, fit_json: Optional[str]):
    """(project's overlap argument, how the projection's header names it)."""
    if fit_json is None:
        return backward_share, f"FP16 overlap {backward_share:g} of compute"
    measured = {(model, methods.canonical(method)): f
                for (model, method), f in overlap_lib.measured_overlaps(fit_json).items()}
    listed = ", ".join(f"{m}/{meth} {f:.2f}" for (m, meth), f in sorted(measured.items())) or "none"
    return measured, f"overlap measured in {fit_json} ({listed}; others 0)"


def json_rows(points, alpha_s: float, local_scale: float) -> List[Dict]:
    """The --json rows: one per (model, link, method, N); "default" is gf_tf's default."""
    return [{"model": p["model"], "method": p["method"], "workers": p["workers"],
             "link_gbit": p["link_gbit"], "alpha_us": alpha_s * 1e6, "local_scale": local_scale,
             "step_ms": p["step_s"] * 1e3, "speedup": p["speedup"], "efficiency": p["efficiency"]}
            for p in points]


def _print_fit(params: Dict[str, float], cells) -> None:
    print("Fitted on", len(cells), "cells:", ", ".join(f"{k} = {v:.4g}" for k, v in params.items()))
    rd = sum(methods.algorithm(c.method) == collectives.RECURSIVE_DOUBLING for c, _, _ in cells)
    print(f"  alpha {params['alpha'] * 1e6:.1f} us per ring hop; rho {params['rho'] * 1e6:.1f} us per "
          f"recursive-doubling round" + ("" if rd else " (no such cells: 2 alpha)") +
          f"; kappa {params['kappa']:.3f} wire/payload; gamma {params['gamma'] * 1e9:.3f} ns/byte; "
          f"local ns/element: TF {params['delta_tf'] * 1e9:.2f}, GF FP16 {params['delta_gf'] * 1e9:.2f}, "
          f"CSC {params['delta_csc'] * 1e9:.2f}\n")
    table, errors = validation_table(params, cells)
    print(f"Fit residuals (median |error| {100 * np.median(np.abs(errors)):.1f}%):\n{table}\n")


def _print_validation(held_out: Dict) -> None:
    if "skipped" in held_out:
        print(f"Validation on held-out N skipped: {held_out['skipped']}\n")
        return
    median, worst = held_out["median_abs_error"], held_out["worst_abs_error"]
    verdict = ("met" if median <= VALIDATION_TARGETS["median"] and worst <= VALIDATION_TARGETS["worst"]
               else "MISSED")
    print(f"Validation: fitted on N in {held_out['fit_workers']} only, predicting the {held_out['cells']} "
          f"cells with N in {held_out['held_out_workers']}: median |error| {100 * median:.1f}%, worst "
          f"{100 * worst:.1f}% (target <= {100 * VALIDATION_TARGETS['median']:.0f}% / "
          f"{100 * VALIDATION_TARGETS['worst']:.0f}%: {verdict})\n{held_out['table']}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", nargs="+", default=[DEFAULT_CALIBRATION],
                        help="benchmarks.allreduce JSON(s) to calibrate on (default: the shipped "
                             "benchmarks/calibration/allreduce.json)")
    parser.add_argument("--validate", nargs="*", default=[], help="JSON(s) of runs not fitted on")
    parser.add_argument("--fit-workers", default="2,3,4",
                        help="validation: fit on the cells with these N, predict the others")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the JSONs were measured on (CPU contention)")
    parser.add_argument("--compute-ms", default=None, help="model=ms per step of one GPU, e.g. alexnet=38.8")
    parser.add_argument("--workers", default="8,16,32,64,128,256,512")
    parser.add_argument("--links", default="10,25,56,100", help="Gbit/s")
    assumed = parser.add_mutually_exclusive_group()
    assumed.add_argument("--backward-share", type=float, default=0.0,
                        help="share of the compute time GradientFlow FP16's packs can hide behind "
                             "(default 0: overlap is opt-in in GradientFlowAllReduce)")
    assumed.add_argument("--fit-json", default=None, metavar="F",
                         help="benchmarks.fit JSON: each model/method's measured overlap instead of "
                              "an assumed share (none measured: no overlap)")
    parser.add_argument("--alpha-us", type=float, default=None,
                        help="replace the fitted alpha (us per hop); rho becomes 2 alpha unless --rho-us")
    parser.add_argument("--rho-us", type=float, default=None,
                        help="replace the fitted rho (us per recursive-doubling round)")
    parser.add_argument("--local-scale", type=float, default=1.0,
                        help="multiply the fitted local costs (gamma, delta_*): e.g. 0.01 for GPU kernels")
    parser.add_argument("--json", default=None, help="write the projection's rows to this JSON path")
    parser.add_argument("--plot", default=os.path.join("benchmarks", "results", "projection.png"))
    args = parser.parse_args(argv)
    try:
        fit_workers = [int(x) for x in args.fit_workers.split(",")]
        worker_counts = [int(x) for x in args.workers.split(",")]
        links = [float(x) for x in args.links.split(",")]
    except ValueError as e:
        raise SystemExit(f"benchmarks.projection: --fit-workers, --workers and --links take "
                         f"comma-separated numbers ({e})") from None

    fit_cells = load_cells(args.fit, args.cores, need=len(PARAMETERS))
    params = fit([c for c, _, _ in fit_cells], [s for _, s, _ in fit_cells])
    _print_fit(params, fit_cells)
    held_out = held_out_validation(fit_cells, fit_workers)
    _print_validation(held_out)
    validate_cells = load_cells(args.validate, args.cores)
    if validate_cells:
        table, errors = validation_table(params, validate_cells)
        print(f"Validation on runs not fitted on (median |error| {100 * np.median(np.abs(errors)):.1f}%, "
              f"worst {100 * max(np.abs(errors)):.1f}%):\n{table}\n")
    fitted = dict(params)
    if args.alpha_us is not None:
        params["alpha"] = args.alpha_us * 1e-6
        params["rho"] = 2 * params["alpha"]
    if args.rho_us is not None:
        params["rho"] = args.rho_us * 1e-6
    for key in LOCAL_PARAMETERS:
        params[key] *= args.local_scale
    compute = _parse_compute(args.compute_ms)
    overlap, overlap_text = _overlap_setting(args.backward_share, args.fit_json)
    print(f"Projection: speedup (scaling efficiency); compute per step {compute} ms; "
          f"alpha {params['alpha'] * 1e6:.1f} us, rho {params['rho'] * 1e6:.1f} us; local costs "
          f"x{args.local_scale:g}; {overlap_text}; one worker per host; "
          f"{methods.LABELS[AUTO]} = gf_tf.plan.planner.choose on these constants\n")
    table, points = projection_table(params, compute, worker_counts, links, overlap)
    print(table + "\n")
    print(comparison(params, compute, overlap))
    if args.json:
        validation = {k: v for k, v in held_out.items() if k != "table"}
        report.write_json(args.json, {
            "rows": json_rows(points, params["alpha"], args.local_scale),
            "fitted_parameters": fitted, "projected_parameters": params, "validation": validation,
            "overlap": overlap if not isinstance(overlap, dict) else
            [{"model": m, "method": meth, "overlap": f} for (m, meth), f in sorted(overlap.items())],
            "auto_plans": [{"model": p["model"], "workers": p["workers"], "link_gbit": p["link_gbit"],
                            "plan": p["plan"].describe()} for p in points if "plan" in p]})
        print(f"\nJSON: {args.json}")
    note = plot(points, args.plot)
    print(f"\nplot: {note}" if note else f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
