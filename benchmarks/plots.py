"""The figures of docs/benchmarks.md, drawn from benchmark JSON files: `python -m benchmarks.plots`.

    python -m benchmarks.plots                              # the committed JSON -> docs/img/*.png
    python -m benchmarks.plots --out-dir /tmp/figures       # somewhere else
    python -m benchmarks.plots --speed benchmarks/results/allreduce.json   # a run of your own

Figures: speed-vs-tf.png (--speed), bytes-vs-density.png (--bytes), projection.png (--projection),
convergence-<task>-<link>.png (--convergence), local-sgd-sweep.png (--sweep); what each reads and
draws: docs/benchmarks.md, "The tools in detail". Needs matplotlib
(`pip install ".[plot]"`); without it, exits with status 2 and writes nothing.
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks import convergence_summary, harness, report
from benchmarks.workers import methods

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SPEED = [os.path.join(RESULTS, "2026-12-02-n2-8.json")]
DEFAULT_BYTES = [os.path.join(RESULTS, "2026-12-03-bytes-density.json"),
                 os.path.join(RESULTS, "2026-12-03-bytes-density-csc10.json"),
                 os.path.join(RESULTS, "2026-12-01-convergence.json")]
DEFAULT_PROJECTION = [os.path.join(RESULTS, f"2026-12-03-projection-{name}.json")
                      for name in ("fitted", "local-0.01", "alpha-10us")]
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "docs", "img")
FIGURES = ("speed-vs-tf.png", "bytes-vs-density.png", "projection.png")
DEFAULT_CONVERGENCE: List[str] = [os.path.join(RESULTS, "2026-12-04-convergence.json")]
CONVERGENCE_METHODS = methods.CONVERGENCE_METHODS   # colours in the table's order
# The sweep's runs, and tf_fp32's seed 0 of the same cell (its target) from the auto-guard report.
DEFAULT_SWEEP = [os.path.join(RESULTS, name) for name in ("2026-12-06-auto-guard-n2.json",
                                                          "2026-12-06-local-sgd-sweep.json")]
SWEEP_FIGURE = "local-sgd-sweep.png"
N_STYLES = {2: "-", 3: "-.", 4: "--", 8: ":"}

SET_LABELS = {"tiny": "tiny", "resnet20": "ResNet-20", "resnet50": "ResNet-50", "alexnet": "AlexNet",
              "digits_cnn": "digits CNN"}
SET_STYLES = {"resnet50": "-", "resnet20": "--", "tiny": ":", "alexnet": "-.", "digits_cnn": "-."}
PROJECTION_METHODS = ("tf_fp32", "default", "gf_fp16", "csc_1", "csc_1_ahead", "csc_1_rd")
METHOD_ORDER = ["default", "gf_fp16", "csc_1", "csc_1_rd", "csc_1_ahead", "csc_0.1", "tf_fp32", "gf_fp16_rd"]


def load(path: str) -> Dict:
    """A benchmark JSON file, its cells', rows' and runs' methods named as in the table ("auto",
    gf_tf's default in files written before it, read as "default")."""
    with open(path) as f:
        doc = json.load(f)
    for key in ("cells", "rows", "runs"):
        for item in doc.get(key, []):
            if "method" in item:
                item["method"] = methods.canonical(item["method"])
    return doc


def _color(method: str) -> str:
    order = METHOD_ORDER + [m for m in methods.METHODS if m not in METHOD_ORDER]
    return f"C{order.index(method) % 10}" if method in order else "black"


def _label(method: str) -> str:
    return methods.LABELS.get(method, method)


def _times_ticks(ax, values: Sequence[float]) -> None:
    """Ticks at the powers of 2 the values span, labelled 0.5x, 1x, 2x, ..."""
    import math
    lo = math.floor(math.log2(min(min(values), 1.0)))
    hi = math.ceil(math.log2(max(max(values), 1.0)))
    ticks = [2.0 ** e for e in range(lo, hi + 1)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()


def _sources(docs: Sequence[Dict], paths: Sequence[str], sep: str = "; ") -> str:
    """The figure's footnote: each file's transcription source, or its run's date and command."""
    notes = []
    for doc, path in zip(docs, paths):
        meta = doc.get("meta", {})
        if "source" in meta:
            notes.append(f"{os.path.basename(path)}: {meta.get('measured', '')}, transcribed from a report")
        elif "date_utc" in meta:
            notes.append(f"{os.path.basename(path)}: measured {meta['date_utc']}")
        else:
            notes.append(os.path.basename(path))
    return sep.join(notes)


def speed_figure(paths: Sequence[str], out: str, plt) -> None:
    """Speed relative to TF's default fp32 against N, one panel per link."""
    docs = [load(p) for p in paths]
    cells = [c for d in docs for c in d["cells"]
             if "speedup_vs_tf_fp32" in c and c["method"] != "tf_fp32" and "error" not in c]
    if not cells:
        raise SystemExit(f"benchmarks.plots: no cells with speedup_vs_tf_fp32 in {', '.join(paths)}")
    links = sorted({c["rate_mbit"] for c in cells}, key=harness.link_order)
    fig, axes = plt.subplots(1, len(links), figsize=(4.6 * len(links), 4.8), squeeze=False, sharey=True)
    series: Dict[tuple, List] = {}
    for c in cells:
        series.setdefault((c["rate_mbit"], c["method"], c["set"], c.get("run")), []).append(
            (c["workers"], c["speedup_vs_tf_fp32"]))
    for ax, link in zip(axes[0], links):
        keys = [k for k in series if k[0] == link]
        for _, method, set_, run in keys:
            pts = sorted(series[(link, method, set_, run)])
            ax.plot([n for n, _ in pts], [s for _, s in pts], marker="o", markersize=4,
                    linestyle=SET_STYLES.get(set_, "-"), color=_color(method))
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_yscale("log", base=2)
        _times_ticks(ax, [s for k in series for _, s in series[k]])
        ax.set_xticks(sorted({n for k in keys for n, _ in series[k]}))
        ax.set_title(f"{report.link_label(link)} links")
        ax.set_xlabel("workers N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speed vs TF default fp32 (1 = TF)")
    shown = {(k[1], k[2]) for k in series}
    handles = [plt.Line2D([], [], color=_color(m), marker="o", label=_label(m))
               for m in METHOD_ORDER if any(m == sm for sm, _ in shown)]
    handles += [plt.Line2D([], [], color="gray", linestyle=SET_STYLES.get(s, "-"), label=SET_LABELS.get(s, s))
                for s in SET_STYLES if any(s == ss for _, ss in shown)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.text(0.01, 0.005, _sources(docs, paths), fontsize=6.5, color="gray")
    report.save_figure(fig, out, dpi=100, bottom=0.14)


def _density(cell: Dict) -> Optional[float]:
    if "density" in cell:
        return cell["density"]
    density = methods.density(cell["method"]) if cell["method"] in methods.TABLE else None
    return None if density == "auto" else 1.0 if density is None else float(density)


def _other_selection(method: str) -> bool:
    """A CSC method whose selection is not per pack (drawn as a marker beside the line)."""
    return method in methods.TABLE and methods.is_csc(method) and methods.csc_selection(method) != "per_pack"


def bytes_figure(paths: Sequence[str], out: str, plt) -> None:
    """Payload (and wire) bytes per worker per step against the density, one line per gradient set
    (the cells of a set may come from several files)."""
    docs = [load(p) for p in paths]
    cells = [c for d in docs for c in d["cells"]
             if "payload_bytes" in c and "error" not in c and _density(c) is not None]
    sets = sorted({c["set"] for c in cells},
                  key=lambda s: list(SET_LABELS).index(s) if s in SET_LABELS else 99)
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    for index, set_ in enumerate(sets):
        mine = [c for c in cells if c["set"] == set_]
        color = f"C{(index + 3) % 10}"
        line = sorted((_density(c), c["payload_bytes"]) for c in mine
                      if c["method"] != "tf_fp32" and not _other_selection(c["method"]))
        ax.plot([d for d, _ in line], [b for _, b in line], marker="o", linestyle="-", color=color,
                label=f"{SET_LABELS.get(set_, set_)}: sent (FP16 wire)")
        for c in mine:
            if c["method"] == "tf_fp32":
                ax.plot([_density(c)], [c["payload_bytes"]], marker="s", color=color, linestyle="none")
            if _other_selection(c["method"]):   # another selection at the same density
                ax.plot([_density(c)], [c["payload_bytes"]], marker="^", color=color, linestyle="none")
        wire = sorted((_density(c), c["wire_tx_bytes_per_worker"]) for c in mine
                      if "wire_tx_bytes_per_worker" in c and c["method"] != "tf_fp32"
                      and not _other_selection(c["method"]))
        if wire:
            ax.plot([d for d, _ in wire], [b for _, b in wire], marker="x", linestyle=":", color=color,
                    label=f"{SET_LABELS.get(set_, set_)}: on the wire (eth0 TX)")
    ax.plot([], [], marker="s", color="gray", linestyle="none", label="dense float32 (TF default)")
    ax.plot([], [], marker="^", color="gray", linestyle="none", label="CSC 1%, chosen a step ahead")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of the gradient's elements sent; 1 = dense)")
    ax.set_ylabel("bytes per worker per step")
    ax.set_title("Bytes per step against density")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.text(0.01, 0.005, _sources(docs, paths, "\n"), fontsize=6, color="gray")
    report.save_figure(fig, out, dpi=100, bottom=0.07)


def projection_figure(paths: Sequence[str], out: str, plt, link_gbit: float) -> None:
    """benchmarks.projection's speedup against N: one row per model, one column per JSON file."""
    docs = [load(p) for p in paths]
    columns = []
    for path, doc in zip(paths, docs):
        rows = [r for r in doc["rows"] if r["link_gbit"] == link_gbit]
        if not rows:
            raise SystemExit(f"benchmarks.plots: {path} holds no rows at {link_gbit:g} Gbit/s (--link-gbit)")
        columns.append((rows, abs(doc.get("fitted_parameters", {}).get("alpha", -1) * 1e6 - rows[0]["alpha_us"])
                        < 1e-6))
    speedup_grid(columns, PROJECTION_METHODS, out, plt, _sources(docs, paths))


def speedup_grid(columns, shown: Sequence[str], out: str, plt, footnote: str) -> None:
    """Projected speedup against N of the methods `shown`: one row per model, one column per
    (benchmarks.projection rows of one link, alpha and local-cost scale; whether alpha is the fitted one);
    the linear speedup dotted, the paper's AlexNet point at 56 Gbit/s a star."""
    models = sorted({r["model"] for rows, _ in columns for r in rows})
    fig, axes = plt.subplots(len(models), len(columns), figsize=(4.4 * len(columns), 3.6 * len(models) + 0.8),
                             squeeze=False, sharey=True)
    speedups = [r["speedup"] for rows, _ in columns for r in rows if r["method"] in shown]
    for j, (rows, fitted) in enumerate(columns):
        link_gbit, alpha_us, scale = rows[0]["link_gbit"], rows[0]["alpha_us"], rows[0]["local_scale"]
        for i, model in enumerate(models):
            ax = axes[i][j]
            for method in shown:
                pts = sorted((r["workers"], r["speedup"]) for r in rows
                             if r["model"] == model and r["method"] == method)
                if pts:
                    ax.plot([n for n, _ in pts], [s for _, s in pts], "o-", markersize=3,
                            color=_color(method))
            ns = sorted({r["workers"] for r in rows})
            ax.plot(ns, ns, ":", color="gray")
            if model == "alexnet" and link_gbit == 56.0:
                ax.plot([512], [410.2], "k*", markersize=10)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            _times_ticks(ax, speedups)
            ax.set_title(f"{SET_LABELS.get(model, model)}, {link_gbit:g} Gbit/s\n"
                         f"alpha {alpha_us:.4g} us{' (fitted)' if fitted else ''}, local costs x{scale:g}",
                         fontsize=9)
            ax.set_xlabel("workers (one per host)")
            ax.grid(True, which="both", alpha=0.3)
    for i in range(len(models)):
        axes[i][0].set_ylabel("projected speedup over 1 worker")
    handles = [plt.Line2D([], [], color=_color(m), marker="o", markersize=3, label=_label(m))
               for m in shown]
    handles += [plt.Line2D([], [], color="gray", linestyle=":", label="linear (N x)"),
                plt.Line2D([], [], color="black", marker="*", linestyle="none", markersize=10,
                           label="GradientFlow paper: AlexNet, 512 GPUs, 410.2x")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.text(0.01, 0.005, footnote, fontsize=6, color="gray")
    report.save_figure(fig, out, dpi=100, bottom=0.09)


def convergence_name(task: str, rate_mbit: Optional[float]) -> str:
    """The file name of one task's and link's convergence figure, e.g. convergence-mnist1d-100mbit.png."""
    return f"convergence-{task}-{'unshaped' if rate_mbit is None else f'{rate_mbit:g}mbit'}.png"


def convergence_figures(paths: Sequence[str], out_dir: str, plt) -> List[str]:
    """Accuracy against seconds and against bytes, one figure per (task, link); returns the paths."""
    docs = [load(p) for p in paths]
    runs = [r for d in docs for r in d["runs"] if "error" not in r]
    written = []
    for task, rate in sorted({(r["task"], r["rate_mbit"]) for r in runs}, key=lambda k: (k[0], *harness.link_order(k[1]))):
        fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(10, 4.2))
        shown = [r for r in runs if (r["task"], r["rate_mbit"]) == (task, rate)]
        for r in shown:
            style = dict(color=f"C{CONVERGENCE_METHODS.index(r['method']) % 10}"
                         if r["method"] in CONVERGENCE_METHODS else "black",
                         linestyle=N_STYLES.get(r["workers"], "-"), marker="o", markersize=3, linewidth=1.2)
            accuracy = [100 * p["test_accuracy"] for p in r["curve"]]
            by_time.plot([p["seconds"] for p in r["curve"]], accuracy, **style)
            by_bytes.plot([max(p["bytes_sent"], 1.0) for p in r["curve"]], accuracy, **style)
        by_time.set_xlabel("training seconds since the first step (evaluation excluded)")
        by_bytes.set_xlabel("bytes a worker put into gradient all-reduces")
        by_bytes.set_xscale("log")
        for ax in (by_time, by_bytes):
            ax.set_ylabel("test accuracy %")
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"{task}, {report.link_label(rate)} links")
        handles = [plt.Line2D([], [], color=f"C{i % 10}", marker="o", label=m)
                   for i, m in enumerate(CONVERGENCE_METHODS) if any(r["method"] == m for r in shown)]
        handles += [plt.Line2D([], [], color="gray", linestyle=N_STYLES.get(n, "-"), label=f"N={n}")
                    for n in sorted({r["workers"] for r in shown})]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
        fig.text(0.01, 0.005, _sources(docs, paths), fontsize=6.5, color="gray")
        path = os.path.join(out_dir, convergence_name(task, rate))
        report.save_figure(fig, path, dpi=100, bottom=0.14)
        written.append(path)
    return written


def _averaging_every(method: str) -> Optional[int]:
    """H of a plain local-SGD method of the table (averaging every H steps, no compression), else None."""
    entry = methods.TABLE.get(method)
    if entry is None or not entry.local or entry.csc or entry.lowrank or entry.local["outer"] != "average":
        return None
    return int(entry.local["sync_every"])


def sweep_figure(paths: Sequence[str], out: str, plt) -> Dict[str, List[tuple]]:
    """Local SGD's trade over H (docs/local-sgd.md): final accuracy, time to target and bytes per
    step of the averaging methods against H, one line per task, N and link, with TensorFlow's
    float32 and float16 all-reduce of the same cell as horizontal lines (medians over seeds).

    Returns, per line ("task, N=n, link"), the points drawn: (H, final accuracy %, seconds to
    target or None, bytes per step)."""
    docs = [load(p) for p in paths]
    cells = convergence_summary.summarize(convergence_summary.merge_runs(docs))
    fig, (acc_ax, time_ax, bytes_ax) = plt.subplots(1, 3, figsize=(13, 4.2))
    drawn = {}
    for key in sorted({(c["task"], c["workers"], c["rate_mbit"]) for c in cells},
                      key=lambda k: (k[0], k[1], *harness.link_order(k[2]))):
        mine = [c for c in cells if (c["task"], c["workers"], c["rate_mbit"]) == key]
        every = [(_averaging_every(c["method"]), c) for c in mine]
        swept = sorted(((h, c) for h, c in every if h), key=lambda hc: hc[0])
        if not swept:
            continue
        i = len(drawn)
        name = f"{key[0]}, N={key[1]}, {report.link_label(key[2])}"
        drawn[name] = [(h, 100 * c["final_accuracy_median"], c["time_to_target_s"], c["bytes_per_step"])
                       for h, c in swept]
        hs, accuracies, times, sent = zip(*drawn[name])
        acc_ax.errorbar(hs, accuracies, color=f"C{i}", marker="o", capsize=3, label=name,
                        yerr=[[a - 100 * c["final_accuracy_min"] for a, (_, c) in zip(accuracies, swept)],
                              [100 * c["final_accuracy_max"] - a for a, (_, c) in zip(accuracies, swept)]])
        time_ax.plot(hs, [float("nan") if t is None else t for t in times], color=f"C{i}", marker="o")
        bytes_ax.plot(hs, sent, color=f"C{i}", marker="o")
        for base, style in (("tf_fp32", ":"), ("tf_fp16", "--")):
            ref = next((c for c in mine if c["method"] == base), None)
            if ref is not None:
                acc_ax.axhline(100 * ref["final_accuracy_median"], color=f"C{i}", linestyle=style, linewidth=1)
                if ref["time_to_target_s"] is not None:
                    time_ax.axhline(ref["time_to_target_s"], color=f"C{i}", linestyle=style, linewidth=1)
                bytes_ax.axhline(ref["bytes_per_step"], color=f"C{i}", linestyle=style, linewidth=1)
    for ax, title in ((acc_ax, "final test accuracy % (median, range over seeds)"),
                      (time_ax, "seconds to the target (tf_fp32's accuracy - 1 point)"),
                      (bytes_ax, "bytes a worker sends per step")):
        ax.set_xscale("log", base=2)
        hs = sorted({h for points in drawn.values() for h, *_ in points})
        ax.set_xticks(hs)
        ax.set_xticklabels([str(h) for h in hs])
        ax.minorticks_off()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("H: steps between meetings")
        ax.grid(True, alpha=0.3)
    fig.suptitle("Local SGD, averaging every H steps (LocalSGD(sync_every=H)): the trade over H", fontsize=10)
    bytes_ax.set_yscale("log")
    handles, _ = acc_ax.get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="gray", linestyle=":", label="tf_fp32 (TF's own all-reduce)"),
                plt.Line2D([], [], color="gray", linestyle="--", label="tf_fp16 (TF's own, cast to float16)")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.text(0.01, 0.005, _sources(docs, paths), fontsize=6.5, color="gray")
    report.save_figure(fig, out, dpi=100, bottom=0.14)
    return drawn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", nargs="+", default=DEFAULT_SPEED, help="benchmarks.allreduce JSON(s)")
    parser.add_argument("--bytes", nargs="+", default=DEFAULT_BYTES, help="JSON(s) with payload_bytes cells")
    parser.add_argument("--projection", nargs="+", default=DEFAULT_PROJECTION,
                        help="benchmarks.projection --json output(s), one column each")
    parser.add_argument("--convergence", nargs="*", default=[p for p in DEFAULT_CONVERGENCE if os.path.exists(p)],
                        help="benchmarks.convergence JSON(s): one figure per task and link")
    parser.add_argument("--sweep", nargs="*", default=[p for p in DEFAULT_SWEEP if os.path.exists(p)],
                        help="benchmarks.convergence JSON(s) with local_H runs: the sweep over H")
    parser.add_argument("--link-gbit", type=float, default=56.0, help="the projection's link rate to draw")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the PNGs go (default docs/img)")
    args = parser.parse_args(argv)
    plt = harness.pyplot()
    if plt is None:
        print(f"benchmarks.plots: {harness.PLOT_MISSING}", file=sys.stderr)
        return 2
    for path in [*args.speed, *args.bytes, *args.projection, *args.convergence, *args.sweep]:
        if not os.path.exists(path):
            raise SystemExit(f"benchmarks.plots: no such file {path}")
    outputs = [os.path.join(args.out_dir, name) for name in FIGURES]
    speed_figure(args.speed, outputs[0], plt)
    bytes_figure(args.bytes, outputs[1], plt)
    projection_figure(args.projection, outputs[2], plt, args.link_gbit)
    if args.convergence:
        outputs += convergence_figures(args.convergence, args.out_dir, plt)
    if args.sweep:
        outputs.append(os.path.join(args.out_dir, SWEEP_FIGURE))
        sweep_figure(args.sweep, outputs[-1], plt)
    plt.close("all")
    for path in outputs:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
