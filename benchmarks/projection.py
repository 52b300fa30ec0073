r"""A calibrated model of step time, from 2 to 512 workers: `python -m benchmarks.projection`.

    python -m benchmarks.projection                       # the shipped calibration, the 8-512 table
    python -m benchmarks.projection --json out.json       # the same, and its rows as JSON
    python -m benchmarks.projection --fit benchmarks/results/allreduce.json \
        [--validate other.json] [--fit-workers 2,3,4] [--compute-ms alexnet=38.8,resnet50=110]
    python -m benchmarks.projection --fit-json benchmarks/results/fit.json   # measured overlap

Projected step time = compute + the all-reduce of benchmarks.step_model (fitted on
benchmarks/calibration/allreduce.json unless --fit); "default" is gf_tf's planner's pick. The model,
the overlap options and the compute-time defaults: docs/benchmarks.md, "The tools in detail".
"""

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from benchmarks import overlap as overlap_lib
from benchmarks import harness, report, step_model
from benchmarks.workers import gradients, methods
from gf_tf import collectives
from gf_tf.plan import Costs, PlanReport, planner
from gf_tf.reducers import DenseReducer

PARAMETERS = step_model.PARAMETERS
AUTO = step_model.AUTO
LOWRANK_METHODS = step_model.LOWRANK_METHODS
PROJECTED_METHODS = ("tf_fp32", "gf_fp16", "gf_fp16_rd", "csc_1", "csc_1_rd", "csc_1_ahead", "csc_1_ahead_rd",
                     "csc_0.1", *LOWRANK_METHODS, AUTO)
COMPARED_METHODS = ("tf_fp32", "gf_fp16", "csc_1", "csc_1_ahead", "csc_0.1", AUTO)   # alpha matters
DEFAULT_CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration",
                                   "allreduce.json")
LOCAL_PARAMETERS = ("gamma", "delta_tf", "delta_gf", "delta_csc")   # scaled by --local-scale
VALIDATION_TARGETS = {"median": 0.15, "worst": 0.35}   # |error| on held-out cells
PAPER_SPEEDUP = {"workers": 512, "link_gbit": 56.0, "model": "alexnet", "speedup": 410.2}
OPEN_SOURCE_SPEEDUP = {"workers": 64, "link_gbit": 56.0, "speedup": 2.5}
DEFAULT_COMPUTE_MS = {"alexnet": 38.8, "resnet50": 128.0}


def step_seconds(comm_seconds: float, compute_seconds: float, overlapped_share: float) -> float:
    """Step time: compute plus the communication not hidden behind `overlapped_share` of it."""
    return compute_seconds + max(0.0, comm_seconds - overlapped_share * compute_seconds)


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
                                          planner_costs(params, link_gbit * 1e9),
                                          control=DenseReducer.wire_control))
        comm, extra["plan"] = plan.steady_seconds or 0.0, plan   # a trial keeps the faster
    else:
        payload, collectives = methods.traffic(method, shapes)
        case = step_model.Case(method, workers, link_gbit * 1e9, elements, payload, collectives)
        comm = step_model.all_reduce_seconds(case, params)
    if isinstance(overlap, dict):   # a measured fraction (benchmarks.overlap) of the shorter of the two
        step = compute_s + comm - overlap.get((model, method), 0.0) * min(comm, compute_s)
    else:   # only FP16 packs hide (CSC's and low rank's collectives wait for the whole step)
        step = step_seconds(comm, compute_s, overlap if method in ("gf_fp16", "gf_fp16_rd") else 0.0)
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


def plot(rows: List[Dict], path: str, fitted: bool) -> Optional[str]:
    """benchmarks.plots' speedup grid of the `json_rows`: one column per link, every projected method."""
    plt = harness.pyplot()
    if plt is None:
        return harness.PLOT_MISSING
    from benchmarks import plots   # pylint: disable=import-outside-toplevel
    links = sorted({r["link_gbit"] for r in rows})
    plots.speedup_grid([([r for r in rows if r["link_gbit"] == link], fitted) for link in links],
                       PROJECTED_METHODS, path, plt, "python -m benchmarks.projection")
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
    table, errors = step_model.validation_table(params, cells)
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

    fit_cells = step_model.load_cells(args.fit, args.cores, need=len(PARAMETERS))
    params = step_model.fit([c for c, _, _ in fit_cells], [s for _, s, _ in fit_cells])
    _print_fit(params, fit_cells)
    held_out = step_model.held_out_validation(fit_cells, fit_workers)
    _print_validation(held_out)
    validate_cells = step_model.load_cells(args.validate, args.cores)
    if validate_cells:
        table, errors = step_model.validation_table(params, validate_cells)
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
    rows = json_rows(points, params["alpha"], args.local_scale)
    if args.json:
        validation = {k: v for k, v in held_out.items() if k != "table"}
        report.write_json(args.json, {
            "rows": rows,
            "fitted_parameters": fitted, "projected_parameters": params, "validation": validation,
            "overlap": overlap if not isinstance(overlap, dict) else
            [{"model": m, "method": meth, "overlap": f} for (m, meth), f in sorted(overlap.items())],
            "auto_plans": [{"model": p["model"], "workers": p["workers"], "link_gbit": p["link_gbit"],
                            "plan": p["plan"].describe()} for p in points if "plan" in p]})
        print(f"\nJSON: {args.json}")
    note = plot(rows, args.plot, params["alpha"] == fitted["alpha"])
    print(f"\nplot: {note}" if note else f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
