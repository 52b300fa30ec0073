"""Shared output helpers of the network benchmarks: Markdown tables, JSON, machine description."""

import datetime
import json
import os
import platform
import subprocess
from typing import List, Sequence


def markdown_table(headers: Sequence[str], rows: List[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value)


def link_label(rate_mbit) -> str:
    if rate_mbit is None:
        return "unshaped"
    return f"{rate_mbit / 1000:g} Gbit/s" if rate_mbit >= 1000 else f"{rate_mbit:g} Mbit/s"


def machine_description(command: str) -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown"
    try:
        from importlib.metadata import version
        tf_version = version("tensorflow-cpu")
    except Exception:  # reported, not fatal
        tf_version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "logical_cpus": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "tensorflow": tf_version, "git_commit": commit,
        "command": command,
        "load_average_at_start": os.getloadavg(),
    }


def save_figure(fig, path: str, dpi: int, bottom: float = 0.0) -> None:
    """Lays out a matplotlib figure above `bottom` (a share of its height kept for a legend or
    footnote) and writes it to `path` as PNG, creating its folder."""
    fig.tight_layout(rect=(0, bottom, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=False)
