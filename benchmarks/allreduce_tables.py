"""The tables and the figure of benchmarks.allreduce, from its cells (what each column means:
docs/benchmarks.md, "Reading the figures")."""

from typing import Dict, List, Optional

from benchmarks import harness, report
from benchmarks.workers import gradients, methods

ALL_SETS = list(gradients.GRADIENT_SETS)


def results_table(cells: List[Dict]) -> str:
    headers = ["gradients", "N", "link", "method", "s/all-reduce", "wire MB/worker", "wire/ideal",
               "bound s", "CPU s", "x bound", "chunk path s", "x limit", "speedup vs TF fp32", "paired vs TF",
               "bottleneck", "pack+unpack %", "GF ops exposed %",
               "collectives", "plan", "check"]
    rows = []
    order = {m: i for i, m in enumerate(methods.METHODS)}
    for c in sorted(cells, key=lambda c: (ALL_SETS.index(c["set"]), c["workers"],
                                          *harness.link_order(c["rate_mbit"]), order[c["method"]])):
        gradients_label = f"{c['set']} ({c['elements'] / 1e6:.2f}M)"
        if "error" in c:
            rows.append([gradients_label, c["workers"], report.link_label(c["rate_mbit"]), c["method"],
                         "FAILED", None, None, None, None, None, None, None, None, None, None, None, None,
                         None, None, c["error"][:80]])
            continue
        check = (f"err {c['max_rel_error']:.1e}" if "max_rel_error" in c else
                 f"nnz {100 * c['nonzero_fraction']:.2g}%" if "nonzero_fraction" in c else "")
        rows.append([gradients_label, c["workers"], report.link_label(c["rate_mbit"]), c["method"],
                     c["median_s"], c["wire_tx_bytes_per_worker"] / 1e6, c["wire_over_ideal"], c["bound_s"],
                     c.get("cpu_s"), c["ratio_to_bound"], c.get("chunk_path_s"), c.get("ratio_to_limit"),
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
            ALL_SETS.index(kv[0][0]), kv[0][1], *harness.link_order(kv[0][2]))):
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
    timed = {(c["set"], c["workers"], c["rate_mbit"], c["method"]): c for c in cells if "median_s" in c}
    rows = []
    for n in (2, 4):
        for rate in (100.0, 1000.0):
            where = f"ResNet-50, N={n}, {report.link_label(rate)}"
            gf = timed.get(("resnet50", n, rate, "gf_fp16"))
            if gf is None:
                rows.append([where, "GF fp16 within 1.1x of its ring bound", "not measured", "-"])
            else:
                rows.append([where, "GF fp16 within 1.1x of its ring bound", f"{gf['ratio_to_bound']:.2f}x",
                             _verdict(gf["ratio_to_bound"] <= 1.1, gf)])
            csc = timed.get(("resnet50", n, rate, "csc_1"))
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
    plt = harness.pyplot()
    if plt is None:
        return harness.PLOT_MISSING
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
