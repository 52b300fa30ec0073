"""How much of a step's communication hides behind its compute, from benchmarks.fit's figures.

overlap = (compute_s + allreduce_s - step_s) / min(compute_s, allreduce_s): 0 when a step costs
their sum, 1 when the shorter is fully hidden; reported as measured. The terms: docs/benchmarks.md, "The
tools in detail".
`measured_overlaps` reads a benchmarks.fit JSON for benchmarks.projection.
"""

import json
import statistics
from typing import Dict, Optional, Tuple


def overlap_fraction(compute_s: float, allreduce_s: float, step_s: float) -> Optional[float]:
    """(compute_s + allreduce_s - step_s) / min(compute_s, allreduce_s), or None when the
    shorter of the two is not positive (nothing to hide)."""
    shorter = min(compute_s, allreduce_s)
    if not shorter > 0:
        return None
    return (compute_s + allreduce_s - step_s) / shorter


def add_overlap(cell: Dict) -> None:
    """Adds "step_s" (the fit's median step time) and, when the cell has compute_s and
    allreduce_s, "overlap" to a benchmarks.fit cell (in place)."""
    if "median_step_s" not in cell:
        return
    cell["step_s"] = cell["median_step_s"]
    if "compute_s" in cell and "allreduce_s" in cell:
        value = overlap_fraction(cell["compute_s"], cell["allreduce_s"], cell["step_s"])
        if value is not None:
            cell["overlap"] = value


def measured_overlaps(path: str) -> Dict[Tuple[str, str], float]:
    """{(model, method): median overlap of its cells, clamped to [0, 1]} of a benchmarks.fit JSON.

    Cells without "overlap" (failed, measured with --no-overlap, or older files) are skipped.
    Raises SystemExit naming the file when it is missing or not a benchmarks.fit result.
    """
    try:
        with open(path) as f:
            cells = json.load(f)["cells"]
        found: Dict[Tuple[str, str], list] = {}
        for cell in cells:
            if cell.get("overlap") is not None:
                found.setdefault((cell["model"], cell["method"]), []).append(float(cell["overlap"]))
    except OSError as e:
        raise SystemExit(f"--fit-json: cannot read {path} ({e.strerror or e}); measure it with "
                         f"`sudo python -m benchmarks.fit --out {path}`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--fit-json: {path} is not a benchmarks.fit result ({type(e).__name__}: {e})") from None
    return {key: min(1.0, max(0.0, statistics.median(values))) for key, values in found.items()}
