"""Learning curves of a reproduction's runs (reproduce.py and scripts/scaling_ladder.py, after training).

plot_curves draws one panel per ladder cell from each seed-0 run's metrics.jsonl (the stable run's train
CE solid, every WSD decay branch (SMELT 3.1) thinner from its fork point, validation dashed) and
results.jsonl (branch endpoints as markers), beside the unigram entropy and the 1.5-nat target.
Read first: train.py (what metrics.jsonl and results.jsonl hold), configs.plan_runs (the run dirs).
"""
from __future__ import annotations

import math
from pathlib import Path

import checks
import configs
from lab import plots


def read_jsonl(path: Path) -> list[dict]:
    """A run's hashed JSON-lines file (each row checked), or [] when absent."""
    return checks.read_jsonl(path) if path.exists() else []


def ce_rows(ms: list[dict]) -> list[dict]:
    """The metrics rows drawn as train CE: a row logged for a validation step between two log intervals
    averages only a few batches, too noisy to draw (its validation loss is still drawn); a segment's last
    row is drawn however few steps it averages: a branch's end, a fork point on the stable run."""
    full = max((m.get("ce_steps", 1) for m in ms), default=1)
    last = {m["branch"]: m for m in sorted(ms, key=lambda m: m["step"])}
    forks = {m["branch"] for m in ms if m["branch"] is not None}
    return [m for m in ms if m.get("ce_steps", full) >= full / 4 or m is last[m["branch"]]
            or (m["branch"] is None and m["step"] in forks)]


def plot_curves(out: Path, ladder: list[dict], entropy: float | None = None, plan: configs.Plan | None = None) -> Path:
    """The learning curves (module docstring) into OUT/figures/curves.png; train CE is each logging window's mean."""
    plt = plots.pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter
    n = len(ladder)
    cols = min(n, 4)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(max(3.6 * cols, 7.2), 3.0 * rows_ + 0.6), squeeze=False, sharey=True)
    colors = plots.arm_colors(configs.cell_arms(ladder[0]) if ladder else [])
    lo, hi, drew_val = math.inf, -math.inf, False
    for ax, cell in zip(axes.flat, ladder):
        for r in configs.plan_runs(out, [cell]):
            ms, c = read_jsonl(r.dir / "metrics.jsonl"), colors[r.arch]
            ms_ce = ce_rows(ms)
            for branch in sorted({m["branch"] for m in ms}, key=lambda b: -1 if b is None else b):
                drawn = [m for m in ms_ce if m["branch"] == branch]
                if branch is not None:   # start the branch at its fork point on the stable curve
                    drawn = [m for m in ms_ce if m["branch"] is None and m["step"] <= branch][-1:] + drawn
                pts = [(m["tokens"], m.get("ce_mean", m["ce"])) for m in drawn]
                if pts:
                    ax.plot(*zip(*pts), color=c, lw=1.4 if branch is None else 0.9, alpha=1.0 if branch is None
                            else 0.75)
                    lo, hi = min(lo, *(p[1] for p in pts)), max(hi, *(p[1] for p in pts))
            val = [(m["tokens"], m["val_loss"]) for m in ms if m["branch"] is None and "val_loss" in m]
            if val:
                ax.plot(*zip(*val), color=c, ls="--", lw=1.0, marker=".", ms=4)
                drew_val = True
            ends = [(x["D"], x["val_loss"]) for x in read_jsonl(r.dir / "results.jsonl")]
            if ends:
                ax.plot(*zip(*ends), ls="none", marker="o", ms=5, mfc="white", mec=c, mew=1.3)
                lo = min(lo, *(e[1] for e in ends))
        if entropy is not None:
            ax.axhline(entropy, color="0.45", ls=":", lw=1)
            ax.axhline(entropy - 1.5, color="0.7", ls=":", lw=1)
        ax.set_title(f"{cell['scale']}  {cell['sparsity_label']}", fontsize=9)
        ax.set_xlabel("training tokens (millions)", fontsize=8)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e6:g}"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss (nats/token)", fontsize=8)
    if math.isfinite(lo):
        top = hi if entropy is None else max(min(hi, entropy + 1.0), entropy + 0.2)
        axes[0, 0].set_ylim(lo - 0.1, top)
    handles = [*(Line2D([], [], color=c, lw=1.4, label=configs.arm_label(a)) for a, c in colors.items()),
               Line2D([], [], color="k", lw=1.4, label="train CE, stable (window mean)"),
               Line2D([], [], color="k", lw=0.9, alpha=0.75, label="train CE, decay branches"),
               *([Line2D([], [], color="k", ls="--", marker=".", label="validation, stable")] if drew_val else []),
               Line2D([], [], color="k", ls="none", marker="o", mfc="white", label="validation, branch endpoints")]
    if entropy is not None:
        handles += [Line2D([], [], color="0.45", ls=":", label=f"unigram entropy {entropy:.2f}"),
                    Line2D([], [], color="0.7", ls=":", label="entropy - 1.5 nats")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if rows_ == 1 else 0.05, 1, 1))
    return Path(plots.save(fig, out / "figures" / "curves.png", dpi=110, tight=False))
