"""The figures of SMELT Section 6 and Appendix D, drawn from probe results (probes.json dicts).

`plot_probes`: one looped model, its Baseline beside it (Fig. 21, 22, 24, 25, 26, 28, 30); `plot_grid`: Fig. 23,
every registered panel (probe_claims.panels), one point per pair with its bootstrap interval over held-out
document groups; `plot_sink_profiles`: every pair's sink profile (App. D, Fig. 56); `plot_dyck`: Fig. 27, the
Dyck head's attention per visit; `plot_pairs`: all of these for a `probe_pairs.probe_pairs` result. Visits are
numbered from 1; with r > 2 a cross-visit figure compares visit v+1 with visit v (probe_claims.visit_words).
Read probes.py and probe_claims.py first; plots.py holds pyplot and save().
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from lab import plots, stats
from lab.probe_claims import _cells, max_visits, pair_intervals, panels, visit_words

VISIT_COLORS = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
_save = plots.save                                                   # at its 120 dpi


def _n_visits(result: dict) -> int:
    return max((d["visit"] for d in result["per_visit"].values()), default=1)


def _visit(result: dict, layer: int, visit: int) -> dict:
    """The per_visit entry of a looped layer's visit (1-based); {} if it has none."""
    return next((d for d in result["per_visit"].values() if d["looped"] and d["layer"] == layer
                 and d["visit"] == visit), {})


def _nan(xs):
    return [float("nan") if x is None else x for x in xs]


def _pair_name(d: dict, n_visits: int) -> str:
    """'layer 3' for a cross-visit pair; 'layer 3 v1-v2' when a layer has more than one pair (r > 2)."""
    return f"layer {d['layer']}" + (f" v{d['visits'][0]}-v{d['visits'][1]}" if n_visits > 2 else "")


def _heat(ax, grid, cmap: str, symmetric: bool = False, annotate: bool = True, vmin=None, vmax=None):
    """imshow on a colour scale fitted to the data (symmetric about 0 for differences), values written in."""
    a = np.asarray(grid, dtype=float)
    finite = a[np.isfinite(a)]
    if vmin is None or vmax is None:
        if symmetric:
            m = float(np.abs(finite).max()) if finite.size else 1.0
            vmin, vmax = -(m or 1.0), (m or 1.0)
        else:
            lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
            vmin, vmax = lo, (hi if hi > lo else lo + 1e-6)
    im = ax.imshow(a, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    if annotate and a.size <= 120:
        mid = (vmin + vmax) / 2
        for (i, j), v in np.ndenumerate(a):
            if np.isfinite(v):
                dark = v < mid if not symmetric else abs(v) > 0.6 * vmax
                ax.text(j, i, f"{v:+.2g}" if symmetric else f"{v:.2g}", ha="center", va="center",
                        fontsize=6, color="white" if dark else "black")
    return im


def _fig21_expert_overlap(result: dict, out_dir: str, tag: str, paths: list[str]) -> None:
    hists = [d["expert_overlap"] for d in result["cross_visit"].values() if "expert_overlap" in d]
    if not hists:
        return
    w = visit_words(_n_visits(result))
    k = hists[0]["k"]
    dist = [sum(h["distribution"][j] for h in hists) / len(hists) for j in range(k + 1)]
    fig, ax = plots.pyplot().subplots(figsize=(5, 3.5))
    ax.bar(range(k + 1), dist, color="tab:blue", label=f"visit {w['a']} vs visit {w['b']} (looped layers)")
    ax.plot(range(k + 1), hists[0]["random_distribution"], "o", color="grey", label="random routing")
    ax.axvline(hists[0]["random_mean"], ls="--", color="purple",
               label=f"random mean k²/n = {hists[0]['random_mean']:.2f}")
    ax.set(xlabel="|S1 ∩ S2| (experts shared)", ylabel="fraction of tokens", xticks=range(k + 1),
           ylim=(0, 1.3 * max(dist + hists[0]["random_distribution"])), title=f"Expert-set overlap (Fig. 21){tag}")
    ax.legend(fontsize=7, loc="upper left")
    _save(fig, os.path.join(out_dir, "fig21_expert_overlap.png"), paths=paths)


def _fig22_residual_flow(result: dict, out_dir: str, tag: str, paths: list[str]) -> None:
    layers = result["looped_layers"]
    if not layers:
        return
    fig, axes = plots.pyplot().subplots(3, 1, figsize=(5, 7), sharex=True)
    for ax, key, name in zip(axes, ("x_rms", "update_rms", "relative_update"),
                             ("residual RMS", "update RMS", "||Δx|| / ||x||")):
        for v in range(1, _n_visits(result) + 1):
            ax.plot(layers, _nan([_visit(result, l, v).get(key) for l in layers]), "o-", color=VISIT_COLORS[v - 1],
                    label=f"visit {v}")
        ax.set_ylabel(name)
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"Residual flow in the looped span (Fig. 22){tag}")
    axes[-1].set(xlabel="physical layer (looped span)", xticks=layers)
    _save(fig, os.path.join(out_dir, "fig22_residual_flow.png"), paths=paths)


def _fig24_update_cosine(result: dict, baseline: dict | None, out_dir: str, tag: str, paths: list[str]) -> None:
    panels_ = [(res, name) for res, name in ((baseline, "Baseline"), (result, "SMELT")) if res]
    fig, axes = plots.pyplot().subplots(1, len(panels_), figsize=(5 * len(panels_), 4.8), squeeze=False)
    offdiag = [abs(x) for res, _ in panels_ for i, row in enumerate(res["update_cosine"]["matrix"] or [])
               for j, x in enumerate(row) if i != j]
    m = max(offdiag, default=1.0) or 1.0
    for ax, (res, name) in zip(axes[0], panels_):
        M, labels = res["update_cosine"]["matrix"], res["update_cosine"]["labels"]
        im = _heat(ax, M, "RdBu_r", vmin=-m, vmax=m, symmetric=True, annotate=len(labels) <= 10)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        span = [i for i, lab in enumerate(labels) if res["per_visit"][lab]["looped"]]
        for edge in ([span[0] - 0.5, span[-1] + 0.5] if span else []):
            ax.axhline(edge, ls="--", color="k", lw=0.8)
            ax.axvline(edge, ls="--", color="k", lw=0.8)
        ax.set_title(f"{name}: update cosine (execution order)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=f"cosine (scale ±{m:.2f}, diagonal = 1)")
    fig.suptitle(f"Residual-update cosine (Fig. 24){tag}", fontsize=9)
    _save(fig, os.path.join(out_dir, "fig24_update_cosine.png"), paths=paths, tight=False)


def _fig25_stage_cosines(result: dict, out_dir: str, tag: str, paths: list[str]) -> None:
    cross = result["cross_visit"]
    if not cross:
        return
    n, w = _n_visits(result), visit_words(_n_visits(result))
    stages = [s for s in next(iter(cross.values()))["cosine"] if s != "update"]   # probes.STAGES, in order
    fig, ax = plots.pyplot().subplots(figsize=(6, 3.5))
    for d in cross.values():
        ax.plot(stages, _nan([d["cosine"][s] for s in stages]), "o-", alpha=0.6, label=_pair_name(d, n))
    ax.plot(stages, _nan([result["summary"][f"cos_{s}"] for s in stages]), "k-s", lw=2, label="mean")
    ax.set(ylabel=f"cosine, visit {w['a']} vs visit {w['b']}",
           title=f"Cross-visit cosine by attention stage (Fig. 25){tag}")
    ax.legend(fontsize=6)
    _save(fig, os.path.join(out_dir, "fig25_cross_visit_cosines.png"), paths=paths)


def _fig26_attended_tokens(result: dict, out_dir: str, tag: str, paths: list[str]) -> None:
    cross = result["cross_visit"]
    if not (cross and any(d["attention"].get("mass") is not None for d in cross.values())):
        return
    n, w = _n_visits(result), visit_words(_n_visits(result))
    keys = [f"top{k}" for k in result["attn_topk"]] + ["mass"]
    fig, axes = plots.pyplot().subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    names = list(cross)
    for ax, key in zip(axes[0], keys):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], _nan([cross[n_]["attention"].get(key) for n_ in names]), 0.4,
               color="tab:blue", label=f"same head, visit {w['a']} vs {w['b']}")
        ax.bar([x + 0.2 for x in xs], _nan([cross[n_]["attention"].get(f"{key}_control") for n_ in names]), 0.4,
               color="grey", label="control: head h vs h + H/2, same layer and visit")
        ax.set_xticks(list(xs), [_pair_name(cross[n_], n) for n_ in names], fontsize=7)
        ax.set(ylim=(0, 1.15), title=f"top-{key[3:]} attended-token overlap" if key != "mass"
               else "attention-mass overlap")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Attended-token overlap (Fig. 26){tag}", fontsize=9)
    _save(fig, os.path.join(out_dir, "fig26_attended_token_overlap.png"), paths=paths)


def _fig28_sink_heads(result: dict, out_dir: str, tag: str, paths: list[str]) -> None:
    layers, n_visits = result["looped_layers"], _n_visits(result)
    if not layers or _visit(result, layers[0], 1)["sink_mass_per_head"] is None:
        return
    grids = [np.array([_nan(_visit(result, l, v)["sink_mass_per_head"]) for l in layers]).T
             for v in range(1, n_visits + 1)]                       # (heads, looped layers) per visit
    lo, hi = float(min(g.min() for g in grids)), float(max(g.max() for g in grids))
    H = grids[0].shape[0]
    fig, axes = plots.pyplot().subplots(1, n_visits + 1, figsize=(3.2 * (n_visits + 1) + 1.5, 1.2 + 0.28 * H + 1.2),
                                        squeeze=False, layout="constrained")
    for v, (ax, g) in enumerate(zip(axes[0], grids), 1):
        im = _heat(ax, g, "magma", vmin=lo, vmax=hi if hi > lo else lo + 1e-6)
        ax.set(title=f"visit {v}")
    fig.colorbar(im, ax=axes[0, :n_visits].tolist(), label=f"segment-start mass ({lo:.3f} to {hi:.3f})")
    im = _heat(axes[0, -1], grids[-1] - grids[0], "RdBu_r", symmetric=True)
    axes[0, -1].set(title=f"visit {n_visits} - visit 1")
    fig.colorbar(im, ax=axes[0, -1], label="difference")
    for ax in axes[0]:
        ax.set(xticks=range(len(layers)), xticklabels=layers, xlabel="physical layer (looped span)",
               yticks=range(H), ylabel="head")
    fig.suptitle(f"Per-head segment-start attention mass (Fig. 28){tag}", fontsize=9)
    _save(fig, os.path.join(out_dir, "fig28_sink_heads.png"), paths=paths, tight=False)


def _fig30_attention_sink(result: dict, baseline: dict | None, out_dir: str, tag: str, paths: list[str]) -> None:
    fig, ax = plots.pyplot().subplots(figsize=(5.5, 3.6))           # Fig. 30 / App. D
    _sink_profile(ax, result, baseline)
    ax.set_title(f"Attention-sink mass by depth (Fig. 30){tag}", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, os.path.join(out_dir, "fig30_attention_sink.png"), paths=paths)


def plot_probes(result: dict, out_dir: str, baseline: dict | None = None, title: str = "") -> list[str]:
    """One figure per SMELT figure the result supports (one looped model, its Baseline beside it)."""
    paths: list[str] = []
    os.makedirs(out_dir, exist_ok=True)
    tag = f" {title}" if title else ""
    _fig21_expert_overlap(result, out_dir, tag, paths)
    _fig22_residual_flow(result, out_dir, tag, paths)
    _fig24_update_cosine(result, baseline, out_dir, tag, paths)
    _fig25_stage_cosines(result, out_dir, tag, paths)
    _fig26_attended_tokens(result, out_dir, tag, paths)
    _fig28_sink_heads(result, out_dir, tag, paths)
    _fig30_attention_sink(result, baseline, out_dir, tag, paths)
    return paths


def _sink_profile(ax, result: dict, baseline: dict | None) -> None:
    """Baseline over all layers; SMELT's unlooped layers; each SMELT visit over the looped span."""
    def line(visits, *fmt, **kw):
        pts = sorted((d["layer"], d["sink_mass"]) for d in visits if d["sink_mass"] is not None)
        if pts:
            ax.plot(*zip(*pts), *fmt, **kw)

    pv = result["per_visit"].values()
    line(baseline["per_visit"].values() if baseline else [], "k--", marker="s", ms=4, label="Baseline")
    line([d for d in pv if not d["looped"]], "o", color="grey", label="SMELT, unlooped layers")
    for v in range(1, _n_visits(result) + 1):
        line([d for d in pv if d["looped"] and d["visit"] == v], "o-", color=VISIT_COLORS[v - 1],
             label=f"SMELT visit {v} (looped span)")
    if result["looped_layers"]:
        ax.axvspan(min(result["looped_layers"]) - 0.3, max(result["looped_layers"]) + 0.3, color="0.92", zorder=0)
    ax.set_xticks(sorted({d["layer"] for d in pv}))
    ax.set(xlabel="physical layer", ylabel="attention on segment start")


def plot_grid(result: dict, path: str, n_draws: int = 1000) -> str:
    """Fig. 23: each probe_claims.panels quantity per matched pair, its 95 % bootstrap interval over held-out
    document groups; grey: its reference (control, random routing, 1)."""
    names, cells = _cells(result)
    rows = panels()
    w = visit_words(max_visits(result))
    n_rows = math.ceil(len(rows) / 4)
    fig, axes = plots.pyplot().subplots(n_rows, 4, figsize=(15, 3.25 * n_rows), squeeze=False)
    xs = np.arange(len(names))
    stored = result.get("pair_intervals", {}) if result.get("n_draws") == n_draws else {}
    for ax, (key, p) in zip(axes.flat, rows):
        ivs = ({n: stats.Interval(**iv) for n, iv in stored[key].items()} if key in stored
               else pair_intervals(result, key, n_draws, _cells_of=(names, cells)))
        if not ivs:
            ax.text(0.5, 0.5, "not measured\n(no pair has it)", ha="center", va="center", transform=ax.transAxes)
        else:
            x = [i for i, n in enumerate(names) if n in ivs]
            m, lo, hi = (np.array([getattr(ivs[names[i]], k) for i in x]) for k in ("mean", "lo", "hi"))
            ax.errorbar(x, m, yerr=[np.nan_to_num(m - lo), np.nan_to_num(hi - m)], fmt="o", color="tab:red",
                        capsize=3, label=f"SMELT, visit {w['b']} vs {w['a']}")
            if p.ref:
                ax.plot(x, _nan([cells[i].value(p.ref) for i in x]), "s", color="grey", label=p.ref_label)
        if p.hline is not None:
            ax.axhline(p.hline, ls="--", color="grey", lw=1)
        ax.set_xticks(xs, names, rotation=30, fontsize=7, ha="right")
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.set_title(f"({p.letter}) {p.title.format(**w)}", fontsize=9)
        if p.ref or p.hline is None:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.suptitle("Cross-visit diagnostics per matched pair (SMELT Fig. 23); bars: 95 % intervals over held-out "
                 "document groups", fontsize=10)
    return _save(fig, path)


def plot_sink_profiles(result: dict, path: str) -> str:
    """Appendix D (Fig. 56): the sink profile of every pair, Baseline vs every SMELT visit."""
    names = result.get("order") or list(result["pairs"])
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plots.pyplot().subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, n in zip(axes.flat, names):
        e = result["pairs"][n]
        _sink_profile(ax, e["smelt"], e["baseline"])
        ax.set_title(n, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6)
    fig.suptitle("Attention-sink mass by depth, every pair (SMELT Fig. 30 / App. D)", fontsize=10)
    return _save(fig, path)


def _dyck_maps(fig, gs, dyck: dict, n_keys: int) -> None:
    """Fig. 27's left column: the Dyck head's attention per visit at the targets, then the last minus the first."""
    ex = dyck["example"]
    att = [np.array(a)[:, :n_keys] for a in ex["attention"]]
    demo = [j for j in ex["demo"] if j < n_keys]
    nv, hi, rows = len(att), float(max(a.max() for a in att)), []
    for v, a in enumerate(att):
        ax = fig.add_subplot(gs[v, 0])
        im = ax.imshow(a, cmap="magma", vmin=0, vmax=hi, aspect="auto")
        ax.set_ylabel(f"visit {dyck['visits'][v]}\ntarget", fontsize=7)
        ax.set_yticks(range(len(a)))
        ax.set_xticks([])
        ax.plot(demo, [-0.7] * len(demo), "|", color="orange", ms=6, clip_on=False)
        rows.append(ax)
    fig.colorbar(im, ax=rows, fraction=0.02, pad=0.01, label=f"attention (0 to {hi:.2f})")
    ax = fig.add_subplot(gs[nv, 0])
    d = att[-1] - att[0]
    m = float(np.abs(d).max()) or 1.0
    im = ax.imshow(d, cmap="RdBu_r", vmin=-m, vmax=m, aspect="auto")
    ax.set_ylabel(f"visit {dyck['visits'][-1]}\n- visit 1", fontsize=7)
    ax.set_yticks(range(len(d)))
    ax.set_xticks(range(n_keys), [t.replace("\n", "⏎") for t in ex["tokens"][:n_keys]], rotation=90, fontsize=4)
    ax.plot(demo, [-0.7] * len(demo), "|", color="orange", ms=6, clip_on=False)
    fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="difference")


def plot_dyck(dyck: dict, path: str, title: str = "") -> str:
    """Fig. 27: the Dyck head's attention at the three targets of a k = 4 prompt on each visit and the last minus
    the first (demonstration-answer keys marked), and its BOS / demonstration mass per visit against k."""
    ex = dyck["example"]
    n_keys = max(ex["targets"]) + 1                                  # later keys are masked for every target
    nv = len(ex["attention"])
    fig = plots.pyplot().figure(figsize=(14, 1.6 * (nv + 1) + 1.2), layout="constrained")
    gs = fig.add_gridspec(nv + 1, 2, width_ratios=[4, 1.2])
    _dyck_maps(fig, gs, dyck, n_keys)
    ax2 = fig.add_subplot(gs[:, 1])
    ks = [int(k) for k in dyck["by_k"]]
    lines = (("bos", "o--", "BOS"), ("demo", "s-", "demo answers"), ("other", "^:", "rest of the prompt"))
    for v in range(nv):
        for key, fmt, what in lines:
            ax2.plot(ks, [dyck["by_k"][str(k)][f"{key}_mass"][v] for k in ks], fmt, color=VISIT_COLORS[v],
                     label=f"{what}, visit {dyck['visits'][v]}", alpha=0.8, ms=7 - 2 * v)
    ax2.set(xscale="log", xticks=ks, xticklabels=ks, xlabel="k demonstrations",
            ylabel="Dyck head's mass at the targets", ylim=(0, 1.02))
    ax2.minorticks_off()
    ax2.legend(fontsize=6, loc="center right")
    h = dyck["head"]
    fig.suptitle(f"Dyck head L{h['layer']} head {h['head']} (ablation raises target loss by {h['effect']:+.3f}), "
                 f"k = {ex['k']} example (orange: demonstration answers) (Fig. 27){' ' + title if title else ''}",
                 fontsize=9)
    return _save(fig, path, tight=False)


def plot_pairs(result: dict, out_dir: str, detail: Sequence[str] | None = None,
               n_draws: int | None = None) -> list[str]:
    """The main job's probe figures: Fig. 23 over all pairs, Appendix D's sink profiles, and the per-pair
    figures (Fig. 21-28, 30, Dyck Fig. 27) for the `detail` pairs (default: the last pair, the largest)."""
    os.makedirs(out_dir, exist_ok=True)
    names = result.get("order") or list(result["pairs"])
    paths = [plot_grid(result, os.path.join(out_dir, "fig23_grid.png"), n_draws or result.get("n_draws", 1000)),
             plot_sink_profiles(result, os.path.join(out_dir, "fig56_sink_profiles.png"))]
    for n in (names[-1:] if detail is None else detail):
        e = result["pairs"][n]
        sub = os.path.join(out_dir, n)
        paths += plot_probes(e["smelt"], sub, baseline=e["baseline"], title=f"({n})")
        if e.get("dyck", {}).get("example"):
            paths.append(plot_dyck(e["dyck"], os.path.join(sub, "fig27_dyck.png"), title=f"({n})"))
    return paths
