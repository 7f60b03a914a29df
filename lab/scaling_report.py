"""What the scaling analysis shows: its figures, tables.md, and SMELT's Table 4.3 recomputed.

`figures`: loss_vs_compute.png (each identified fit along every cell's D range, the S = 0 controls hollow),
reducible_loss.png (SMELT Fig. 9: L - E with each fit's frontier L* - E) and ce_gain.png (Eq. 5, dotted where
extrapolated, with the bootstrap band); axes span the data.  `markdown`: tables.md (coefficients only of
identified fits, brackets, † where extrapolated).  `paper_tables`: Table 4.3 from the printed coefficients.

Read first: scaling.py and scaling_analysis.py (what it passes here).
"""
from __future__ import annotations

import math
import os
import textwrap
from typing import Sequence

import numpy as np

from lab import plots
from scaling import (CONTROL_LABEL, GAIN_FLOOR, PAPER_BASELINE, PAPER_BUDGETS, PAPER_CE_GAIN_PCT, PAPER_SMELT,
                     PAPER_SPARSITIES, PAPER_TPP_1E21, Coeffs, Points, ce_gain, frontier_loss, loss, tpp)


def _log_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = math.log10(float(np.min(x))), math.log10(float(np.max(x)))
    d = max(hi - lo, 0.2) * pad
    return 10 ** (lo - d), 10 ** (hi + d)


def _lin_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = float(np.min(x)), float(np.max(x))
    d = max(hi - lo, 1e-3 * max(abs(hi), 1.0)) * pad
    return lo - d, hi + d


def _cell_curves(co: Coeffs, p: Points):
    """Per cell: (C, L_hat) along the cell's own D range at its mean F and S."""
    for c in sorted(set(p.cell)):
        m = p.cell == c
        D = np.geomspace(p.D[m].min(), p.D[m].max(), 20)
        F, S = float(np.exp(np.log(p.F[m]).mean())), float(p.S[m].mean())
        yield c, F * D, loss(co, F, S, D)


def _labels(p: Points) -> np.ndarray:
    return np.array([c.split("/", 1)[1] for c in p.cell])


def figures(out: str, pts: dict, control: dict, fits: dict, why: dict, cols: dict,
            gain_plot: dict | None, names: tuple[str, str]) -> list[str]:
    """Draws the three figures (module docstring) that the data allow; returns the file names written."""
    plt = plots.pyplot()
    colours = dict(zip(cols, plt.cm.viridis(np.linspace(0, 0.85, max(len(cols), 1)))))
    allC = np.concatenate([p.F * p.D for d in (pts, control) for p in d.values()])
    allL = np.concatenate([p.L for d in (pts, control) for p in d.values()])
    xlim, ylim = _log_limits(allC), _lin_limits(allL)
    drawn = {"loss_vs_compute.png": _loss_vs_compute(plt, pts, control, fits, why, cols, colours, xlim, ylim)}
    ident = [a for a in sorted(fits) if a in pts]
    if ident and cols:
        drawn["reducible_loss.png"] = _reducible_loss(plt, pts, fits, ident, cols, xlim)
    if gain_plot is not None:
        drawn["ce_gain.png"] = _ce_gain(plt, gain_plot, cols, colours, names)
    for name, fig in drawn.items():
        plots.save(fig, os.path.join(out, name), dpi=120)
    return list(drawn)


def _loss_vs_compute(plt, pts: dict, control: dict, fits: dict, why: dict, cols: dict, colours: dict,
                     xlim: tuple, ylim: tuple):
    archs = sorted(set(pts) | set(control))
    fig, axes = plt.subplots(1, len(archs), figsize=(5.8 * len(archs), 4.6), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        p = pts.get(arch)
        if p is not None:
            for lab in cols:
                m = _labels(p) == lab
                ax.scatter(p.F[m] * p.D[m], p.L[m], color=colours[lab], s=18, label=lab, zorder=3)
            if arch in fits:
                for cell, C, Lh in _cell_curves(fits[arch], p):
                    ax.plot(C, Lh, color=colours[cell.split("/", 1)[1]], lw=1, alpha=0.8)
        if arch in control:
            q = control[arch]
            ax.scatter(q.F * q.D, q.L, facecolors="none", edgecolors="0.5", s=22,
                       label=f"{CONTROL_LABEL} control (left out of the fit)", zorder=3)
        if arch in fits:
            title = f"{arch}: Eq. 2 fit (lines: each cell along its D)"
        elif p is None:
            title = f"{arch}: control cells only (nothing fitted)"
        else:
            w = why.get(arch, [])
            body = "; ".join(w[:2]) + (f"; +{len(w) - 2} more" if len(w) > 2 else "")
            title = f"{arch}: data only, fit not identified\n" + "\n".join(textwrap.wrap(body, 60))
        ax.set(xscale="log", xlim=xlim, ylim=ylim, xlabel="training compute C = F D (FLOPs)",
               ylabel="validation loss (nats)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return fig


def _reducible_loss(plt, pts: dict, fits: dict, ident: list, cols: dict, xlim: tuple):
    fig, axes = plt.subplots(1, len(cols), figsize=(4.8 * len(cols), 4.2), squeeze=False)
    colours = plots.arm_colors(ident)
    for ax, (lab, s) in zip(axes[0], cols.items()):
        ys, dropped = [], 0
        for i, arch in enumerate(ident):
            p, co, col = pts[arch], fits[arch], colours[arch]
            m = _labels(p) == lab
            r = p.L[m] - co.E
            dropped += int((r <= 0).sum())
            ok = r > 0
            ax.scatter((p.F[m] * p.D[m])[ok], r[ok], marker="os^v"[i % 4], s=18, label=arch,
                       edgecolors=col, facecolors="none" if i == 0 else col, zorder=3)
            ys.append(r[ok])
            for cell, C, Lh in _cell_curves(co, p.take(np.flatnonzero(m))):
                ax.plot(C, Lh - co.E, color=col, lw=1, alpha=0.8)
            Cg = np.geomspace(float((p.F * p.D).min()), float((p.F * p.D).max()), 30)
            fr = frontier_loss(co, Cg, s) - co.E
            ax.plot(Cg, fr, color=col, ls="--", lw=1, label=f"{arch} frontier L* - E")
            ys.append(fr)
        y = np.concatenate(ys)
        y = y[y > 0] if (y > 0).any() else np.array([1.0])
        ax.set(xscale="log", yscale="log", xlim=xlim, ylim=_log_limits(y), xlabel="C (FLOPs)",
               ylabel="L - E (nats, each fit's own E)")
        ax.set_title(f"{lab}: reducible loss" + (f" ({dropped} points below E not shown)" if dropped else ""),
                     fontsize=9)
        ax.legend(fontsize=7)
    if missing := sorted(set(pts) - set(ident)):
        fig.suptitle(f"not drawn (fit not identified): {', '.join(missing)}", fontsize=9)
    return fig


def _ce_gain(plt, gain_plot: dict, cols: dict, colours: dict, names: tuple[str, str]):
    Cg, g, ext, band = gain_plot["C"], gain_plot["pct"], gain_plot["extrapolated"], gain_plot.get("band")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lo_show, clipped = -300.0, False
    for j, lab in enumerate(cols):
        y = g[:, j]                                      # nan where the gain lies below GAIN_FLOOR
        ax.plot(Cg, np.where(~ext[:, j], y, np.nan), color=colours[lab], label=f"{lab}")
        near = ext[:, j].copy()                          # dotted where extrapolated, joined to the solid part
        near[1:] |= ext[:-1, j]; near[:-1] |= ext[1:, j]
        ax.plot(Cg, np.where(near, y, np.nan), color=colours[lab], ls=":")
        if band is not None:
            ax.fill_between(Cg, np.maximum(band[0][:, j], lo_show), band[1][:, j], color=colours[lab], alpha=0.2)
            clipped |= bool((band[0][:, j] < lo_show).any())
    ax.axhline(0, color="0.4", lw=0.8)
    shown = [g[np.isfinite(g)], [0.0]] + ([np.maximum(band[0], lo_show).ravel(), band[1].ravel()] if band else [])
    ax.set_ylim(*_lin_limits(np.concatenate(shown)))
    ax.set(xscale="log", xlim=_log_limits(Cg, 0.02),
           xlabel=f"{names[0]} compute C (FLOPs), over both fits' common compute range",
           ylabel="CE gain (% of reference compute saved)")
    t = f"CE gain of {names[0]} over {names[1]} on the frontier"
    if band is not None:
        t += f"\nband: 95 % cell bootstrap, {100 * gain_plot['failed_share']:.0f} % of draws failed"
    if clipped:
        t += f"; band clipped at {lo_show:.0f} %"
    if ext.any():
        t += "\ndotted: extrapolated (see tables.json)"
    ax.set_title(t, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def format_table(title: str, row_names: Sequence[str], col_names: Sequence[str], cells) -> str:
    """A small markdown table; cells is a (rows, cols) nested list of strings."""
    lines = [f"### {title}", "", "| | " + " | ".join(col_names) + " |", "|---" * (len(col_names) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(row) + " |" for name, row in zip(row_names, cells)]
    return "\n".join(lines) + "\n"


def pct_text(g: float | None) -> str:
    """A gain (fraction) as a signed percentage with at most 4 integer digits."""
    if g is None or g < GAIN_FLOOR:
        return "< -9999"
    return f"{100 * g:+.1f}"


def failed_text(share: float | None) -> str:
    """' (2.5 % of draws failed)' beside a bootstrap interval; '' when no bootstrap ran."""
    return "" if share is None else f" ({100 * share:.1f} % of draws failed)"


def cell_text(fmt, value, cell: dict) -> str:
    """A table cell: `value` in `fmt`, its bootstrap bracket, † when extrapolated, its failed share."""
    iv = cell.get("interval")
    return (fmt(value) + (f" [{fmt(iv['lo'])}, {fmt(iv['hi'])}]" if iv else "") + ("†" if cell["extrapolated"] else "")
            + failed_text(cell.get("failed_share")))


def tpp_text(x: float) -> str:
    """TPP as an integer between 10 and 1e6, else 3 significant digits (never a long number)."""
    return f"{x:.0f}" if 10 <= x < 1e6 else f"{x:.3g}"


def why_text(why: Sequence[str]) -> str:
    return "not identified (" + "; ".join(why) + ")"


def why_short(why: Sequence[str]) -> str:
    """The reason keys only, for tables after the first (which prints them in full)."""
    keys = list(dict.fromkeys(w.split(":")[0] for w in why))
    return "not identified (" + ", ".join(keys) + "; details in the coefficients table)"


def paper_tables() -> str:
    """SMELT Tables 4.3 (CE gain, TPP at 1e21) recomputed from the printed coefficients."""
    cols = [f"S = {round(100 * s)} %" for s in PAPER_SPARSITIES]
    gain = [[f"{100 * ce_gain(PAPER_SMELT, PAPER_BASELINE, C, s):.1f} (paper {p:.1f})"
             for s, p in zip(PAPER_SPARSITIES, PAPER_CE_GAIN_PCT[C])] for C in PAPER_BUDGETS]
    tp = [[f"{tpp(co, 1e21, s):.0f} (paper {p})" for s, p in zip(PAPER_SPARSITIES, PAPER_TPP_1E21[arch])]
          for arch, co in (("baseline", PAPER_BASELINE), ("smelt", PAPER_SMELT))]
    note = ("Recomputed from the coefficients as printed in SMELT Table 4.3. The CE gain moves by up to\n"
            "~1 pp within the rounding of those coefficients, so entries can differ from the paper's by ~0.1 pp.\n")
    return (format_table("CE gain of SMELT over Baseline (%)", [f"C = {C:.0e}" for C in PAPER_BUDGETS], cols, gain)
            + "\n" + format_table("TPP at C = 1e21", ["Baseline", "SMELT"], cols, tp) + "\n" + note)


def markdown(report: dict) -> str:
    """tables.md: fits (coefficients only when identified), CE gain, TPP, subsets; no number over 8 digits."""
    cols, target, ref = report["sparsity"], report["gains"]["target"], report["gains"]["ref"]
    labs = list(cols)
    md = ["## Scaling-law fits (SMELT Eq. 2)\n"]
    ctl = (f"The {report['n_control_rows']} rows of the `{CONTROL_LABEL}` control cells are left out of the fits "
           f"(SMELT 4.3)." if report["n_control_rows"] else
           "The control cells are included (--include-dense)." if report["include_dense"] else
           "There are no control cells.")
    reps = report.get("seed_means") or {}
    md.append(ctl + (f" Cells only one architecture has (left out): {', '.join(report['unmatched_cells'])}."
                     if report["unmatched_cells"] else "")
              + (" Seed replicates are averaged into one point per endpoint before fitting: "
                 + ", ".join(f"{k} ({n} seeds)" for k, n in reps.items()) + "." if reps else "") + "\n")
    cells = []
    for a, e in report["fits"].items():
        rg = e.get("ranges")
        data = [str(e["n_points"]), "–" if rg is None else f"{rg['C'][0]:.2e} to {rg['C'][1]:.2e}"]
        if e["identified"]:
            se = e["se"]
            exp = [f"{e[k]:.4f}" + (f" ± {se[k]:.3f}" if k in se and math.isfinite(se[k]) else
                                     " (pinned)" if k in e["fixed"] else "") for k in "abc"]
            cells.append(["identified", f"{e['E']:.4f}", f"{e['A']:.4g}", f"{e['K']:.4g}", *exp,
                          f"{e['gamma']:.3f}", f"{e['rmse_nats']:.4f}", *data])
        else:
            cells.append([why_text(e["why"]), *["–"] * 8, *data])
    head = ["status", "E", "A", "K", "a", "b", "c", "gamma", "RMSE (nats)", "points", "C range (FLOPs)"]
    md.append(format_table("Coefficients (± Gauss-Newton standard error)", list(report["fits"]), head, cells))
    short = {a: f"{a} {why_short(e['why'])}" for a, e in report["fits"].items() if not e["identified"]}
    g, budgets = report["gains"], report["budgets"]
    g_why = [short[a] for a in (target, ref) if a in short] or g["why"]
    if g["available"]:
        by = {(c["budget"], c["sparsity_label"]): c["text"] for c in g["cells"]}
        md.append(format_table(f"CE gain of {target} over {ref} (%, at {report['budget_rule']})",
                               [f"C = {C:.2e}" for C in budgets], [f"{l} (S = {cols[l]:.2f})" for l in labs],
                               [[by[(C, l)] for l in labs] for C in budgets]))
    else:
        md.append(f"### CE gain of {target} over {ref}\n\nNot computed: {'; '.join(g_why)}.\n")
    tp_cells = [[c["text"] for c in t["cells"]] if t["available"] else
                [short[a].removeprefix(a + " ") if a in short else "; ".join(t["why"])] + ["–"] * (len(labs) - 1)
                for a, t in report["tpp"].items()]
    if tp_cells and labs:
        C = report["tpp_budget"]
        md.append(format_table("Compute-optimal tokens per parameter, TPP" + (f" at C = {C:.2e}" if C else ""),
                               list(report["tpp"]), labs, tp_cells))
    notes = []
    for name, b in report["bootstrap"].items():
        fails = ", ".join(f"{k} ({v})" for k, v in sorted(b["failures"].items(), key=lambda kv: -kv[1]))
        notes.append(f"Bootstrap `{name}`: {b['n_draws']} cell resamples, each refitting "
                     f"{' and '.join(b['surfaces'])}; {b['n_failed']} failed ({100 * b['failed_share']:.0f} %)"
                     + (f": {fails}" if fails else "") + ".")
    if notes:
        notes.append("Brackets are the 2.5 / 97.5 percentiles over every draw, a failed draw counted as -inf for "
                     "the lower and +inf for the upper bound (not conditional on success); a cell without brackets "
                     "has none (see interval_why in tables.json).")
    if any(c.get("extrapolated") for c in g["cells"]) or any(
            c.get("extrapolated") for t in report["tpp"].values() for c in t["cells"]):
        notes.append("† extrapolated: the budget, C_ref or a compute-optimal F* / D* lies outside the data of a "
                     "fitted surface (reasons in tables.json).")
    md += [n + "\n" for n in notes]
    if not g["available"]:
        md.append(f"Per-subset and quartile gains: not computed ({'; '.join(g_why)}).\n")
    elif report["subsets"]:
        md.append("### Per-subset CE gain (SMELT 5.2; intercepts refitted with the aggregate exponents)\n")
        md += _subset_tables(report, labs, target, ref)
    return "\n".join(md)


def _subset_tables(report: dict, labs: list, target: str, ref: str) -> list[str]:
    """SMELT 5.2's tables: the CE gain per domain / source, those not fitted, the Baseline-loss quartiles."""
    md = []
    for key, sub in report["subsets"].items():
        what, C, gains = key.removeprefix("val_loss_by_"), sub["budget"], sub["gains"]
        if gains:
            md.append(format_table(f"CE gain (%) of {target} over {ref} by {what} at C = {C:.2e}", list(gains), labs,
                                   [[cell_text(pct_text, v[lab]["gain"], v[lab]) for lab in labs]
                                    for v in gains.values()]))
        if sub["not_fitted"]:
            md.append(f"Not fitted ({what}): " + "; ".join(f"{n}: {w}" for n, w in sub["not_fitted"].items()) + "\n")
    q = report["quartiles"]
    if q["available"]:
        md.append(format_table(f"CE gain (%) by Baseline-loss quartile ({q['sparsity_label']}, C = {q['budget']:.2e})",
                               ["CE gain"], [f"Q{i + 1}" for i in range(len(q["gain"]))],
                               [[cell_text(pct_text, x, q) for x in q["gain"]]]))
    return md
