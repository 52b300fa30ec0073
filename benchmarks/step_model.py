r"""The all-reduce model of benchmarks.projection, its fit on benchmarks.allreduce cells, and its check.

T = alpha-beta-gamma latency, wire and reduction terms of the method's collectives (Thakur,
Rabenseifner & Gropp 2005) + a local cost per element; seven parameters (PARAMETERS) fitted by
non-negative least squares on relative error, then checked on held-out N. The formulas:
docs/benchmarks.md, "The tools in detail".
"""

import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import report
from benchmarks.workers import gradients, methods
from gf_tf import collectives
from gf_tf.collectives import recursive_doubling
from gf_tf.plan import DEFAULT_BYTES_PER_PACK

PARAMETERS = ("alpha", "rho", "kappa", "gamma", "delta_tf", "delta_gf", "delta_csc")
AUTO = "default"   # gf_tf's default: the planner's pick
LOWRANK_METHODS = tuple(m for m in methods.METHODS if methods.get(m).lowrank is not None)
CSC_METHODS = tuple(m for m in methods.METHODS if methods.is_csc(m))
MODELLED_METHODS = ("tf_fp32", "gf_fp16", "gf_fp16_rd", *CSC_METHODS)


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
    """Modelled seconds of one step's all-reduce (docs/benchmarks.md, benchmarks.step_model)."""
    return float(features(case) @ np.array([params[p] for p in PARAMETERS]))


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

    rho without recursive-doubling cases is 2 alpha (a 2-member ring).
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
