"""The scaling analysis's figures: the data with each fit, the reducible loss, the CE gain.

* loss_vs_compute.png: validation loss against training compute C = F D per architecture, each
  identified Eq. 2 fit drawn along every cell's own D range, the S = 0 control cells hollow.
* reducible_loss.png: SMELT Fig. 9, L - E per sparsity column with each fit's frontier L* - E
  (Eq. 4), identified fits only.
* ce_gain.png: the CE gain (Eq. 5) over both fits' common compute range, dotted where
  extrapolated, with the cell-bootstrap band.
Axes span the data, never the paper's budgets.  `figures` draws all three (scaling_analysis.analyse
calls it); plots.py gives the headless pyplot and the one way to save.

Read first: scaling.py (loss, frontier_loss) and scaling_analysis.py (what it passes here).
"""
from __future__ import annotations

import math
import os
import textwrap
from typing import Sequence

import numpy as np

from lab import plots
from scaling import CONTROL_LABEL, Coeffs, Points, frontier_loss, loss


def _log_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = math.log10(float(np.min(x))), math.log10(float(np.max(x)))
    d = max(hi - lo, 0.2) * pad
    return 10 ** (lo - d), 10 ** (hi + d)


def _lin_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = float(np.min(x)), float(np.max(x))
    d = max(hi - lo, 1e-3 * max(abs(hi), 1.0)) * pad
    return lo - d, hi + d


def _reason_title(head: str, why: Sequence[str], width: int = 60) -> str:
    body = "; ".join(why[:2]) + (f"; +{len(why) - 2} more" if len(why) > 2 else "")
    return head + "\n" + "\n".join(textwrap.wrap(body, width))


def _cell_curves(co: Coeffs, p: Points):
    """Per cell: (C, L_hat) along the cell's own D range at its mean F and S (the fit on the data)."""
    for c in sorted(set(p.cell)):
        m = p.cell == c
        D = np.geomspace(p.D[m].min(), p.D[m].max(), 20)
        F, S = float(np.exp(np.log(p.F[m]).mean())), float(p.S[m].mean())
        yield c, F * D, loss(co, F, S, D)


def fits_range(p: Points) -> tuple[float, float]:
    C = p.F * p.D
    return float(C.min()), float(C.max())


def _labels(p: Points) -> np.ndarray:
    """The sparsity label of every point (its cell id is "scale/label")."""
    return np.array([c.split("/", 1)[1] for c in p.cell])


def figures(out: str, pts: dict, control: dict, fits: dict, why: dict, cols: dict,
            gain_plot: dict | None, names: tuple[str, str]) -> list[str]:
    """loss_vs_compute.png (data, and each identified fit along every cell's own D range),
    reducible_loss.png (SMELT Fig. 9, identified fits only) and ce_gain.png (both identified).
    Axes span the data, never the paper's budgets.  Returns the file names written."""
    plt = plots.pyplot()
    colours = dict(zip(cols, plt.cm.viridis(np.linspace(0, 0.85, max(len(cols), 1)))))
    allC = np.concatenate([p.F * p.D for d in (pts, control) for p in d.values()])
    allL = np.concatenate([p.L for d in (pts, control) for p in d.values()])
    xlim, ylim = _log_limits(allC), _lin_limits(allL)
    written = [_loss_vs_compute(out, pts, control, fits, why, cols, colours, xlim, ylim)]
    ident = [a for a in sorted(fits) if a in pts]
    if ident and cols:
        written.append(_reducible_loss(out, pts, fits, ident, cols, xlim))
    if gain_plot is not None:
        written.append(_ce_gain(out, gain_plot, cols, colours, names))
    return written


def _loss_vs_compute(out: str, pts: dict, control: dict, fits: dict, why: dict, cols: dict, colours: dict,
                     xlim: tuple, ylim: tuple) -> str:
    """loss_vs_compute.png: the data of every architecture, and each identified fit along every cell's D."""
    plt = plots.pyplot()
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
            title = _reason_title(f"{arch}: data only, fit not identified", why.get(arch, []))
        ax.set(xscale="log", xlim=xlim, ylim=ylim, xlabel="training compute C = F D (FLOPs)",
               ylabel="validation loss (nats)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    plots.save(fig, os.path.join(out, "loss_vs_compute.png"), dpi=120)
    return "loss_vs_compute.png"


def _reducible_loss(out: str, pts: dict, fits: dict, ident: list, cols: dict, xlim: tuple) -> str:
    """reducible_loss.png (SMELT Fig. 9): L - E on the sparse grid, one panel per sparsity column,
    identified fits only, with each fit's frontier L* - E."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(cols), figsize=(4.8 * len(cols), 4.2), squeeze=False)
    for ax, (lab, s) in zip(axes[0], cols.items()):
        ys, dropped = [], 0
        for i, arch in enumerate(ident):
            p, co, col = pts[arch], fits[arch], f"C{i}"
            m = _labels(p) == lab
            r = p.L[m] - co.E
            dropped += int((r <= 0).sum())
            ok = r > 0
            ax.scatter((p.F[m] * p.D[m])[ok], r[ok], marker="os^v"[i % 4], s=18, label=arch,
                       edgecolors=col, facecolors="none" if i == 0 else col, zorder=3)
            ys.append(r[ok])
            for cell, C, Lh in _cell_curves(co, p.take(np.flatnonzero(m))):
                ax.plot(C, Lh - co.E, color=col, lw=1, alpha=0.8)
            Cg = np.geomspace(*fits_range(p), 30)
            fr = frontier_loss(co, Cg, s) - co.E
            ax.plot(Cg, fr, color=col, ls="--", lw=1, label=f"{arch} frontier L* - E")
            ys.append(fr)
        y = np.concatenate(ys) if ys else np.array([1.0])
        y = y[y > 0] if (y > 0).any() else np.array([1.0])
        ax.set(xscale="log", yscale="log", xlim=xlim, ylim=_log_limits(y), xlabel="C (FLOPs)",
               ylabel="L - E (nats, each fit's own E)")
        ax.set_title(f"{lab}: reducible loss" + (f" ({dropped} points below E not shown)" if dropped else ""),
                     fontsize=9)
        ax.legend(fontsize=7)
    missing = sorted(set(pts) - set(ident))
    if missing:
        fig.suptitle(f"not drawn (fit not identified): {', '.join(missing)}", fontsize=9)
    plots.save(fig, os.path.join(out, "reducible_loss.png"), dpi=120)
    return "reducible_loss.png"


def _ce_gain(out: str, gain_plot: dict, cols: dict, colours: dict, names: tuple[str, str]) -> str:
    """ce_gain.png: the CE gain of names[0] over names[1] along the common compute range, per sparsity
    column, dotted where extrapolated, with the cell-bootstrap band when there is one."""
    plt = plots.pyplot()
    Cg, g, ext, band = gain_plot["C"], gain_plot["pct"], gain_plot["extrapolated"], gain_plot.get("band")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lo_show, clipped = -300.0, False
    for j, lab in enumerate(cols):
        y = np.where(np.isfinite(g[:, j]), g[:, j], np.nan)
        ins = ~ext[:, j]
        ax.plot(Cg, np.where(ins, y, np.nan), color=colours[lab], label=f"{lab}")
        near = ext[:, j].copy()                          # dotted where extrapolated, joined to the solid part
        near[1:] |= ext[:-1, j]; near[:-1] |= ext[1:, j]
        ax.plot(Cg, np.where(near, y, np.nan), color=colours[lab], ls=":")
        if band is not None:
            ax.fill_between(Cg, np.maximum(band[0][:, j], lo_show), band[1][:, j], color=colours[lab], alpha=0.2)
            clipped |= bool((band[0][:, j] < lo_show).any())
    ax.axhline(0, color="0.4", lw=0.8)
    vals = [g[np.isfinite(g)]] + ([np.maximum(band[0], lo_show).ravel(), band[1].ravel()] if band is not None else [])
    v = np.concatenate(vals) if vals else np.array([0.0])
    ax.set_ylim(*_lin_limits(np.concatenate([v, [0.0]])))
    ax.set(xscale="log", xlim=_log_limits(Cg, 0.02), xlabel=f"{names[0]} compute C (FLOPs), over both fits' common compute range",
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
    plots.save(fig, os.path.join(out, "ce_gain.png"), dpi=120)
    return "ce_gain.png"
