"""The figures of the downstream evaluation (SMELT Section 5, Appendix C): shot sweeps (Fig. 20b-c for one
endpoint, Fig. 51 over the grid), the Eq. 6 calibration and the gain by document length (Fig. 20a).
Nothing is drawn for at-chance tasks or unidentified fits: each function returns a sentence saying what
it left out, and writes no file when nothing is left.
Read before: tasks.py, calibration.py, downstream_claims.py. Plumbing (headless pyplot, save): plots.py.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from lab import plots
from lab.calibration import CALIBRATION_METRICS, sigmoid4
from lab.tasks import chance_of


def plot_shot_sweep(result: dict, path: str | Path, other: dict | None = None) -> str:
    """Accuracy vs k per task (mean +- s.e. over seeds) of one endpoint (and a compared one, dashed); tasks
    never above chance in either are left out."""
    results = [result] + ([other] if other else [])
    above = lambda t: any(r["acc"] > chance_of(t) + 1e-12 for r in t["by_k"].values())   # at some k
    drawn = {o: [n for n, t in result["tasks"].items() if t["origin"] == o
                 and any(n in r["tasks"] and above(r["tasks"][n]) for r in results)]
             for o in ("bigbench", "generated")}
    left = sorted(n for n, t in result["tasks"].items() if n not in drawn[t["origin"]])
    note = (f"At or below chance at every k (not drawn): {', '.join(left)}." if left else "")
    panels = [o for o in drawn if drawn[o]]
    if not panels:
        return (note + " No task is above chance: no shot-sweep figure.").strip()
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, origin in zip(axes[0], panels):
        for i, name in enumerate(drawn[origin]):
            for res, style in ((result, "-"), (other, "--")):
                if res is None or name not in res["tasks"]:
                    continue
                ks = sorted(res["tasks"][name]["by_k"], key=int)
                rs = [res["tasks"][name]["by_k"][k] for k in ks]
                ax.errorbar(range(len(ks)), [r["acc"] for r in rs], [r["acc_se"] for r in rs], ls=style,
                            marker="o", ms=3, color=f"C{i}", label=name if style == "-" else None)
                ax.set_xticks(range(len(ks)), ks)
            ax.axhline(chance_of(result["tasks"][name]), color=f"C{i}", lw=0.6, ls=":")
        ax.set(title=f"{'BIG-bench (DCLM Core)' if origin == 'bigbench' else 'generated'} tasks"
               + (" (dashed: compared run)" if other else "") + "; dotted: chance",
               xlabel="demonstrations k", ylabel="accuracy")
        ax.legend(fontsize=7)
    plots.save(fig, path, dpi=120)
    return note


def plot_icl_sweep(sweep: dict, path: str | Path) -> str:
    """SMELT Fig. 51 from icl_sweep: per task, Baseline (dashed) and SMELT (solid) accuracy vs k averaged over
    the cells where both are above chance (bars: standard error over demonstration seeds)."""
    drawn = [n for n, t in sweep.items() if any(r["cells_above"] for r in t["by_k"].values())]
    left = [n for n in sweep if n not in drawn]
    note = (f"No cell has both models above chance at any k for: {', '.join(left)} (not drawn)." if left else "")
    if not drawn:
        return (note + " No task is above chance in any cell: no shot-sweep figure.").strip()
    plt = plots.pyplot()
    cols = min(4, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, drawn):
        t = sweep[name]
        ks = [k for k in t["ks"] if t["by_k"][str(k)]["cells_above"]]
        for arch, style in (("baseline", "--"), ("smelt", "-")):
            color = plots.ARM_COLORS[arch]
            se = [float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
                  for v in (t["by_k"][str(k)][f"{arch}_by_seed"] for k in ks)]
            ax.errorbar(range(len(ks)), [t["by_k"][str(k)][arch] for k in ks], se, ls=style, marker="o", ms=3,
                        color=color, capsize=2, label="Baseline" if arch == "baseline" else "SMELT")
        ax.set_xticks(range(len(ks)), ks)
        ax.axhline(t["chance"], color="grey", lw=0.6, ls=":")
        p = t["test"]["p"]
        cells = ", ".join(str(t["by_k"][str(k)]["cells_above"]) for k in ks)
        ax.set_title(f"{name}: cells above chance {cells} of {t['by_k'][str(ks[0])]['cells']}\n"
                     + (f"SMELT > Baseline at k={t['test']['k']}: p = {p:.3f} (min {t['test']['p_min']:.3f})"
                        if p is not None else f"no test: {t['test']['why']}"), fontsize=8)
        ax.set_xlabel("demonstrations k", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    plots.save(fig, path, dpi=110)
    return note


def plot_calibration(base: Sequence[dict], others: Sequence[dict], report: dict, path: str | Path) -> str:
    """Metric vs validation loss for every identified Eq. 6 fit: Baseline endpoints, the curve, the others."""
    spec = {m: (origin, key) for m, origin, key, *_ in CALIBRATION_METRICS}
    metrics = [m for m in spec if report.get("metrics", {}).get(m, {}).get("identified")]
    skipped = {m: c["why"] for m, c in report.get("metrics", {}).items()
               if not m.startswith("task/") and not c.get("identified")}
    note = " ".join(f"Calibration of {m} not identified: {why}." for m, why in skipped.items())
    if not metrics:
        return (note + " No calibration figure.").strip()
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        c = report["metrics"][m]
        p = c["params"]
        origin, key = spec[m]
        xs = [e["val"]["loss"] for e in [*base, *others]]
        grid = np.linspace(min(xs), max(xs), 200)
        ax.plot(grid, sigmoid4(grid, p["a"], p["b"], p["alpha"], p["tau"], p["d"]), "k-", lw=1,
                label=f"Eq. 6 fit on Baseline, R2={p['r2']:.3f}")
        for es, mk, lab in ((base, "o", "Baseline"), (others, "^", "SMELT")):
            ax.scatter([e["val"]["loss"] for e in es], [e["summary"][origin][key] for e in es], marker=mk, s=14,
                       label=lab)
        n_in = sum(c["inside"])
        # no interval here: endpoints of one run share its trajectory; the claim's interval is over runs (REPORT.md)
        ax.set(xlabel="validation loss", ylabel={"core": "mean centred accuracy",
                                                 "completion": "gold-answer loss (nats/token)"}[key],
               title=f"{m}: SMELT's mean residual (Eq. 7)\n{c['mean_residual']:+.4f} over {n_in} endpoints"
               + (f" ({c['extrapolated']} outside the Baseline losses left out)" if c.get("extrapolated") else "")
               + "; its interval over runs: REPORT.md")
        ax.title.set_fontsize(10)
        ax.legend(fontsize=7)
    plots.save(fig, path, dpi=120)
    return note


def plot_length_families(families: dict, path: str | Path) -> str:
    """SMELT Fig. 20a: each family's mean normalised gain by document-length bucket (log2 axis)."""
    fams = {f: v for f, v in families.items() if len(v.get("shape") or {}) >= 2}
    note = " ".join(f"{f}: {v['why']}." for f, v in families.items() if f not in fams and v.get("why"))
    if not fams:
        return (note + " No length-shape figure.").strip()
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for (f, v), style in zip(fams.items(), ("o-", "s--", "^:")):   # distinct styles: overlapping lines stay visible
        b = sorted(v["shape"], key=int)
        iv = v["long_short"]
        ratio = ("no long/short ratio" if iv is None else f"long/short {iv['mean']:.2f}"
                 + (f" [{iv['lo']:.2f}, {iv['hi']:.2f}]" if math.isfinite(iv["lo"]) else " (no interval)"))
        ax.plot([int(x) for x in b], [v["shape"][x] for x in b], style, ms=4,
                label=f"{f}: {ratio} (paper {v['paper']}), {v['n_contrasts']} contrasts"
                + (f", {v['n_negative']} with a mean loss, not gain" if v.get("n_negative") else ""))
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ticks = sorted({int(b) for v in fams.values() for b in v["shape"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    drop = {b: n for v in fams.values() for b, n in v.get("buckets_dropped", {}).items()}
    ax.set(xlabel="document length bucket (tokens, upper bound)"
           + ("\nleft out, too few tokens: " + ", ".join(f"<= {b} ({n} tokens)" for b, n in drop.items())
              if drop else ""),
           ylabel="gain / mean gain", title="Loss gain by document length (SMELT 5.3, Fig. 20a)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22 if drop else -0.16))
    plots.save(fig, path, dpi=120)
    return note


def plot_downstream(report: dict, records: Sequence[dict], out_dir: str | Path) -> dict:
    """downstream_report's figures into out_dir (shot_sweep, calibration, length_families .png):
    {"figures": {name: path or None}, "notes": [what was not drawn]}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base, smelt = ([r for r in records if r["arch"] == a] for a in ("baseline", "smelt"))
    figures, notes = {}, []
    for name, draw in (("shot_sweep", lambda p: plot_icl_sweep(report["icl"], p)),
                       ("calibration", lambda p: plot_calibration(base, smelt, report["calibration"], p)
                        if "error" not in report["calibration"] else f"Calibration: {report['calibration']['error']}."),
                       ("length_families", lambda p: plot_length_families(report["families"], p))):
        path = out / f"{name}.png"
        path.unlink(missing_ok=True)            # never leave a stale figure of an earlier run behind
        note = draw(path)
        figures[name] = str(path) if path.exists() else None
        if note:
            notes.append(note)
    return {"figures": figures, "notes": notes}
