r"""A calibrated model of step time, from 2 to 512 workers: `python -m benchmarks.projection`.

    python -m benchmarks.projection --fit benchmarks/results/calibration.json \
        --validate benchmarks/results/validation.json [--compute-ms alexnet=38.8,resnet50=110]

1. Fit. The all-reduce of one step of method m (TF default fp32, GradientFlow
   FP16, CSC at density d) on N workers whose ring links carry B bit/s is
   modelled as (alpha-beta-gamma model of a ring all-reduce, plus our local
   costs):

     T = alpha * 2(N-1) * c_m                       per-hop latency, c_m collectives
       + kappa * 2(N-1)/N * P_m * 8 / B             wire time of P_m payload bytes
       + (gamma * (N-1)/N * P_m + delta_m * E) * s  reduction and local work
                                                    (E elements of the model)

   beta, the seconds per byte on the wire, is 8 / B times kappa (wire bytes over
   payload bytes: TCP/IP and gRPC framing, ideally 1); B is the goodput that
   benchmarks.allreduce measured in the same run. delta_m is the local cost per
   element of the model: TF's own copies (tf_fp32), pack + unpack (gf_fp16), the
   CSC chunk path (csc_*). s = max(1, N / cores) is the CPU contention of the
   emulation (N worker processes share this machine's cores); it is 1 in the
   projection (a worker per host). The six parameters (alpha, kappa, gamma,
   delta_tf, delta_gf, delta_csc) are fitted by non-negative least squares on
   relative error, on the cells of `--fit` (JSON of benchmarks.allreduce).
2. Validate. The fitted model predicts the cells of `--validate` (runs it was
   not fitted on, e.g. N = 3 at 500 Mbit/s); each prediction error is printed.
3. Project. Step time = compute + the part of the all-reduce not hidden
   behind compute: GradientFlow FP16 sends its packs during backprop (hides
   up to `--backward-share` of the compute time); TF's default (one batch
   all-reduce after the last gradient in Keras) and CSC (two collectives
   after the last gradient) hide nothing. Scaling efficiency = compute / step
   time; speedup = N x efficiency.

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
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import report
from benchmarks.workers import gradients, methods
from gf_tf.cross_device_ops import DEFAULT_BYTES_PER_PACK
from gf_tf.sparsity import DEFAULT_CHUNK_SIZE, selected_chunk_count

PARAMETERS = ("alpha", "kappa", "gamma", "delta_tf", "delta_gf", "delta_csc")
PROJECTED_METHODS = ("tf_fp32", "gf_fp16", "csc_1", "csc_0.1")
PAPER_SPEEDUP = {"workers": 512, "link_gbit": 56.0, "model": "alexnet", "speedup": 410.2}
OPEN_SOURCE_SPEEDUP = {"workers": 64, "link_gbit": 56.0, "speedup": 2.5}
DEFAULT_COMPUTE_MS = {"alexnet": 38.8, "resnet50": 128.0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One all-reduce of a gradient set: what the model needs to know about it.

    workers: N. link_bps: ring goodput per link, bit/s. elements: E.
    payload_bytes: P, bytes each worker puts into collectives per step.
    collectives: c, collectives per step. cpu_share: s (>= 1).
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
    local = np.zeros(3)
    local[_local_index(case.method)] = case.elements * case.cpu_share
    return np.concatenate([[2.0 * h * case.collectives,
                            2.0 * h / n * case.payload_bytes * 8.0 / case.link_bps,
                            h / n * case.payload_bytes * case.cpu_share], local])


def all_reduce_seconds(case: Case, params: Dict[str, float]) -> float:
    """Modelled seconds of one step's all-reduce (module docstring, step 1)."""
    return float(features(case) @ np.array([params[p] for p in PARAMETERS]))


def step_seconds(comm_seconds: float, compute_seconds: float, overlapped_share: float) -> float:
    """Step time: compute plus the communication not hidden behind `overlapped_share` of it."""
    return compute_seconds + max(0.0, comm_seconds - overlapped_share * compute_seconds)


def _local_index(method: str) -> int:
    if method == "tf_fp32":
        return 0
    if method == "gf_fp16":
        return 1
    if method in methods.CSC_DENSITY:
        return 2
    raise ValueError(f"no model for method {method!r}; choose tf_fp32, gf_fp16 or csc_*")


def fit(cases: Sequence[Case], seconds: Sequence[float]) -> Dict[str, float]:
    """Non-negative least squares on relative error: min sum((T_model / T - 1)^2), parameters >= 0.

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
            return dict(zip(PARAMETERS, coef.tolist()))
        free.remove(int(np.argmin(coef)))


# -- what each method sends ---------------------------------------------------------------

def pack_sizes(shapes: Sequence[Tuple[int, ...]]) -> List[int]:
    """Elements per pack of a float32 gradient list on a float16 wire, as GradientFlow cuts it."""
    import tensorflow as tf
    from gf_tf import packing
    signature = [(tf.TensorShape(s), tf.float32) for s in shapes]
    plan = packing.plan_packs(signature, DEFAULT_BYTES_PER_PACK, lambda dtype: tf.float16)
    return [p.num_elements for p in plan]


def method_traffic(method: str, shapes) -> Tuple[float, int]:
    """(payload bytes per worker per step, collectives per step) of `method` on a gradient list."""
    elements = gradients.num_elements(shapes)
    if method == "tf_fp32":
        return 4.0 * elements, 1            # TF's batch all-reduce concatenates into one collective
    packs = pack_sizes(shapes)
    if method == "gf_fp16":
        return 2.0 * elements + 4.0 * len(shapes), len(packs) + 1   # packs + the bounds' control
    density = methods.CSC_DENSITY[method]
    if density == "auto":
        raise ValueError(f"{method}: the density is chosen at run time; no fixed traffic to model")
    chunks = [math.ceil(n / DEFAULT_CHUNK_SIZE) for n in packs]
    if methods.csc_selection(method) == "global":   # one top K over all chunks (one wire dtype)
        selected = selected_chunk_count(sum(chunks), density)
    else:
        selected = sum(selected_chunk_count(c, density) for c in chunks)
    payload = 2.0 * selected * DEFAULT_CHUNK_SIZE + 4.0 * sum(chunks)
    return payload, 2                      # the norms' all-reduce and the chunks' all-reduce


def overlapped_share(method: str, backward_share: float) -> float:
    return backward_share if method == "gf_fp16" else 0.0


# -- measured cells -----------------------------------------------------------------------

def measured_cases(path: str, cores: int) -> List[Tuple[Case, float, Dict]]:
    """(case, measured seconds, cell) for every successful cell of a benchmarks.allreduce JSON."""
    with open(path) as f:
        cells = json.load(f)["cells"]
    out = []
    for cell in cells:
        if "median_s" not in cell or cell["method"] not in ("tf_fp32", "gf_fp16", *methods.CSC_DENSITY):
            continue
        if methods.CSC_DENSITY.get(cell["method"]) == "auto":
            continue   # csc_auto's traffic changes from step to step: not a sample of a fixed-traffic model
        shapes = gradients.GRADIENT_SETS[cell["set"]]
        payload, collectives = method_traffic(cell["method"], shapes)
        case = Case(cell["method"], cell["workers"], cell["goodput_bps"], cell["elements"],
                    cell.get("payload_bytes", payload), collectives,
                    max(1.0, cell["workers"] / cores))
        out.append((case, cell["median_s"], cell))
    return out


_MEASURE_HINT = ("measure them first: `sudo python -m benchmarks.allreduce` (the full preset, about "
                 "30 minutes; `--quick` is a smoke test of 3 cells, too few to fit) writes "
                 "benchmarks/results/allreduce.json")


def load_cells(paths: Sequence[str], cores: int, need: int = 0) -> List[Tuple[Case, float, Dict]]:
    """The measured cells of every benchmarks.allreduce JSON in `paths`.

    Raises SystemExit with what to run when a file is missing or unreadable, or
    when fewer than `need` usable cells (fixed-traffic methods that succeeded) remain.
    """
    cells = []
    for path in paths:
        try:
            cells += measured_cases(path, cores)
        except FileNotFoundError:
            raise SystemExit(f"benchmarks.projection: no measurements at {path}; {_MEASURE_HINT}") from None
        except (json.JSONDecodeError, KeyError) as e:
            raise SystemExit(f"benchmarks.projection: {path} is not a benchmarks.allreduce result "
                             f"({type(e).__name__}: {e})") from None
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


# -- projection ---------------------------------------------------------------------------

def project(params, model: str, method: str, workers: int, link_gbit: float, compute_s: float,
            backward_share: float) -> Dict[str, float]:
    shapes = gradients.GRADIENT_SETS[model]
    payload, collectives = method_traffic(method, shapes)
    case = Case(method, workers, link_gbit * 1e9, gradients.num_elements(shapes), payload, collectives)
    comm = all_reduce_seconds(case, params)
    step = step_seconds(comm, compute_s, overlapped_share(method, backward_share))
    return {"comm_s": comm, "step_s": step, "efficiency": compute_s / step,
            "speedup": workers * compute_s / step}


def projection_table(params, compute_ms, worker_counts, links, backward_share) -> Tuple[str, List[Dict]]:
    rows, points = [], []
    for model in compute_ms:
        for link in links:
            for method in PROJECTED_METHODS:
                row = [model, f"{link:g} Gbit/s", methods.LABELS[method]]
                for n in worker_counts:
                    p = project(params, model, method, n, link, compute_ms[model] / 1e3, backward_share)
                    points.append({"model": model, "link_gbit": link, "method": method, "workers": n, **p})
                    row.append(f"{p['speedup']:.1f}x ({100 * p['efficiency']:.0f}%)")
                rows.append(row)
    headers = ["model", "link", "method"] + [f"N={n}" for n in worker_counts]
    return report.markdown_table(headers, rows), points


def alpha_for_speedup(params, target: float, model: str, method: str, workers: int, link_gbit: float,
                      compute_s: float, backward_share: float) -> Optional[float]:
    """The largest alpha (s per hop) at which `method` still reaches `target` speedup, or None."""
    def speedup(alpha):
        return project({**params, "alpha": alpha}, model, method, workers, link_gbit, compute_s,
                       backward_share)["speedup"]
    if speedup(0.0) < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) >= target else (lo, mid)
    return lo


def comparison(params, compute_ms, backward_share) -> str:
    n, link, target = PAPER_SPEEDUP["workers"], PAPER_SPEEDUP["link_gbit"], PAPER_SPEEDUP["speedup"]
    compute_s = compute_ms["alexnet"] / 1e3
    lines = [f"Paper: AlexNet, {n} GPUs, {link:g} Gbit/s: {target}x. Open-source systems it beat: "
             f"{OPEN_SOURCE_SPEEDUP['speedup']}x on {OPEN_SOURCE_SPEEDUP['workers']} GPUs."]
    for method in PROJECTED_METHODS:
        p = project(params, "alexnet", method, n, link, compute_s, backward_share)
        tf64 = project(params, "alexnet", method, OPEN_SOURCE_SPEEDUP["workers"], link, compute_s,
                       backward_share)
        alpha = alpha_for_speedup(params, target, "alexnet", method, n, link, compute_s, backward_share)
        network_only = {**params, **dict.fromkeys(("gamma", "delta_tf", "delta_gf", "delta_csc"), 0.0)}
        free = alpha_for_speedup(network_only, target, "alexnet", method, n, link, compute_s, backward_share)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", required=True, nargs="+", help="benchmarks.allreduce JSON(s) to calibrate on")
    parser.add_argument("--validate", nargs="*", default=[], help="JSON(s) of runs not fitted on")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the JSONs were measured on (CPU contention)")
    parser.add_argument("--compute-ms", default=None, help="model=ms per step of one GPU, e.g. alexnet=38.8")
    parser.add_argument("--workers", default="8,16,32,64,128,256,512")
    parser.add_argument("--links", default="10,25,56,100", help="Gbit/s")
    parser.add_argument("--backward-share", type=float, default=2 / 3,
                        help="share of the compute time GradientFlow FP16's packs can hide behind")
    parser.add_argument("--alpha-us", type=float, default=None, help="replace the fitted alpha (us per hop)")
    parser.add_argument("--local-scale", type=float, default=1.0,
                        help="multiply the fitted local costs (gamma, delta_*): e.g. 0.01 for GPU kernels")
    parser.add_argument("--plot", default=os.path.join("benchmarks", "results", "projection.png"))
    args = parser.parse_args(argv)

    fit_cells = load_cells(args.fit, args.cores, need=len(PARAMETERS))
    params = fit([c for c, _, _ in fit_cells], [s for _, s, _ in fit_cells])
    print("Fitted on", len(fit_cells), "cells:", ", ".join(f"{k} = {v:.4g}" for k, v in params.items()))
    print(f"  alpha {params['alpha'] * 1e6:.1f} us per hop; kappa {params['kappa']:.3f} wire/payload; "
          f"gamma {params['gamma'] * 1e9:.3f} ns/byte; local ns/element: TF {params['delta_tf'] * 1e9:.2f}, "
          f"GF FP16 {params['delta_gf'] * 1e9:.2f}, CSC {params['delta_csc'] * 1e9:.2f}\n")
    table, errors = validation_table(params, fit_cells)
    print(f"Fit residuals (median |error| {100 * np.median(np.abs(errors)):.1f}%):\n{table}\n")
    validate_cells = load_cells(args.validate, args.cores)
    if validate_cells:
        table, errors = validation_table(params, validate_cells)
        print(f"Validation on runs not fitted on (median |error| {100 * np.median(np.abs(errors)):.1f}%, "
              f"worst {100 * max(np.abs(errors)):.1f}%):\n{table}\n")
    if args.alpha_us is not None:
        params["alpha"] = args.alpha_us * 1e-6
    for key in ("gamma", "delta_tf", "delta_gf", "delta_csc"):
        params[key] *= args.local_scale
    compute = _parse_compute(args.compute_ms)
    worker_counts = [int(x) for x in args.workers.split(",")]
    links = [float(x) for x in args.links.split(",")]
    print(f"Projection: speedup (scaling efficiency); compute per step {compute} ms; "
          f"alpha {params['alpha'] * 1e6:.1f} us; local costs x{args.local_scale:g}; one worker per host\n")
    table, points = projection_table(params, compute, worker_counts, links, args.backward_share)
    print(table + "\n")
    print(comparison(params, compute, args.backward_share))
    note = plot(points, args.plot)
    print(f"\nplot: {note}" if note else f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
