"""Time to accuracy from benchmarks.convergence's runs: the target, time to it, and the cells over seeds."""

import statistics
from typing import Dict, List, Optional, Sequence

from benchmarks.workers import methods

BASELINE = "tf_fp32"
TARGET_MARGIN = 0.01   # the target: tf_fp32's median final accuracy minus 1 point


def time_to_target(curve: Sequence[Dict], target: float) -> Optional[float]:
    """Seconds of the first curve point whose test accuracy is >= target, or None if none is.

    curve: points {"seconds": float, "test_accuracy": float} in training order.
    """
    for point in curve:
        if point["test_accuracy"] is not None and point["test_accuracy"] >= target:
            return float(point["seconds"])
    return None


def median_time_to_target(times: Sequence[Optional[float]]) -> Optional[float]:
    """Median over seeds with "not reached" (None) counted as later than any time; None if that
    median is "not reached" (fewer than half the seeds reached the target)."""
    if not times:
        return None
    ordered = sorted(times, key=lambda t: (t is None, t or 0.0))
    middle = ordered[(len(ordered) - 1) // 2: len(ordered) // 2 + 1]
    return None if None in middle else statistics.mean(middle)


def cell_key(run: Dict) -> tuple:
    """A run's cell: (task, N, link in Mbit/s or None, method)."""
    return run["task"], run["workers"], run["rate_mbit"], run["method"]


def paired_time_ratio(times: Dict[int, Optional[float]], base: Dict[int, Optional[float]]) -> Optional[float]:
    """Median over the seeds where tf_fp32 reached the target of time / tf_fp32's time, per seed
    (paired: a seed is the same data order and initial weights in both); a seed this method did
    not reach counts as slower than any; None if that median is not reached or no seed pairs.

    times, base: seed -> seconds to target, or None (not reached)."""
    return median_time_to_target([None if times[s] is None else times[s] / base[s]
                                  for s in sorted(times) if base.get(s) is not None])


def summarize(runs: List[Dict]) -> List[Dict]:
    """Per cell (task, N, link, method) over its seeds' runs: final accuracy median and range, its
    difference to tf_fp32, the target, the median time to target and its paired ratio to tf_fp32's
    (`paired_time_ratio`), bytes per step, load average."""
    cells: Dict[tuple, List[Dict]] = {}
    for r in runs:
        if "error" not in r:
            cells.setdefault(cell_key(r), []).append(r)
    base = {k[:3]: statistics.median(x["final_accuracy"] for x in v)
            for k, v in cells.items() if k[3] == BASELINE}
    times = {k: {r["seed"]: time_to_target(r["curve"], base[k[:3]] - TARGET_MARGIN) for r in rs}
             for k, rs in cells.items() if k[:3] in base}
    out = []
    for (task, n, rate, method), rs in cells.items():
        accuracies = [r["final_accuracy"] for r in rs]
        reference = base.get((task, n, rate))
        mine, base_times = times.get((task, n, rate, method), {}), times.get((task, n, rate, BASELINE), {})
        out.append({"task": task, "workers": n, "rate_mbit": rate, "method": method, "seeds": len(rs),
                    "final_accuracy_median": statistics.median(accuracies),
                    "final_accuracy_min": min(accuracies), "final_accuracy_max": max(accuracies),
                    "vs_tf_fp32_points": None if reference is None
                    else 100 * (statistics.median(accuracies) - reference),
                    "target": None if reference is None else reference - TARGET_MARGIN,
                    "times_to_target_s": list(mine.values()),
                    "time_to_target_s": median_time_to_target(list(mine.values())),
                    "time_vs_tf_fp32": paired_time_ratio(mine, base_times),
                    "bytes_per_step": statistics.median(r["sent_bytes_per_step"] for r in rs),
                    "seconds_median": statistics.median(r["curve"][-1]["seconds"] for r in rs),
                    "load_average_1min": [min(r["load_average_1min"] for r in rs),
                                          max(r["load_average_1min"] for r in rs)]})
    return out


def merge_runs(payloads: Sequence[Dict]) -> List[Dict]:
    """The runs of several `benchmarks.convergence` JSON payloads, in order; a later payload's run of the
    same task, N, link, method and seed replaces an earlier one (a cell re-run after a change)."""
    keyed: Dict[tuple, Dict] = {}
    for payload in payloads:
        for r in payload["runs"]:
            r = {**r, "method": methods.canonical(r["method"])}   # "auto": an older file's "default"
            keyed[(*cell_key(r), r["seed"])] = r
    return list(keyed.values())
