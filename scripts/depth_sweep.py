"""SMELT Table 3.4: physical depth, for the Baseline and the looped model, on one budget.

  python scripts/depth_sweep.py --preset smoke|tiny|small [--depths 4 6 8] [--scale S] [--sparsity LABEL]

The reference is the preset Baseline (physical depth L) and its ladder SMELT. At every other physical
depth P an unlooped Baseline and a looped model (SMELT's loop) are matched to the reference's FLOPs,
parameters and KV cache (budget.match with target=ref, `depth_pair`); a "matched" column shows a depth
that cannot be. Writes results.json, a table and depth_sweep.png (validation loss against effective
depth). The searches in full: docs/scripts.md, "depth_sweep.py".
"""
from __future__ import annotations

import math
import warnings
from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

import budget
import checks
from loop import SMELT, LoopConfig
from model import ModelConfig

DEPTH_FACTORS = {"smoke": (0.5, 1.0, 1.5), "tiny": (2 / 3, 1.0, 4 / 3), "small": (0.75, 1.0, 1.25, 1.5)}


def heads_search(ref: ModelConfig) -> dict:
    """head_dim and KV heads searched wide enough to meet ref's KV width at another depth (KV ~ depth x width);
    d_ff and query width within +-50 % of the centre's proportions (a wider band lets the expert count
    absorb the budget: 200 experts of width 4)."""
    return {"hd_range": (0.5, 2.5), "n_kv_heads": tuple(range(1, 2 * ref.n_kv_head + 1)), "ff_band": 0.5,
            "q_band": 0.5}


def depth_pair(ref: ModelConfig, P: int, ctx: float, search: dict) -> tuple[ModelConfig, ModelConfig]:
    """(Baseline, looped) of physical depth P, both matched to ref's budgets from the preset's search options
    `search`; at ref's own depth, the ladder's pair."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the table's "matched" column says it
        if P == ref.n_layer:
            return ref, budget.match(ref, SMELT.at(P), ctx, **search)[0]
        wide = {**search, **heads_search(ref)}
        d = max(4, round(ref.d_model * math.sqrt(ref.n_layer / P) / 4) * 4)   # FLOPs ~ depth x width^2
        hd = max(2, round(ref.hd * ref.n_layer / P / 2) * 2)                   # KV ~ depth x head width
        kv = ref.n_kv_head   # the query width keeps its proportion to d_model, in whole KV groups
        center = replace(ref, n_layer=P, d_model=d, head_dim=hd, d_ff=max(4, round(ref.d_ff * d / ref.d_model / 4) * 4),
                         n_head=max(1, round(ref.n_head * ref.hd * d / ref.d_model / hd / kv)) * kv)
        base = budget.match(center, LoopConfig(), ctx, target=ref, **{**wide, "d_range": (0.75, 1.25)})[0]
        return base, budget.match(base, SMELT.at(P), ctx, target=ref, **wide)[0]


def build_parser():
    ap = common.parser(__doc__, scale="of the reference (default: the deepest)")
    ap.add_argument("--depths", type=checks.positive_int, nargs="+", default=None,
                    help="physical depths (default: the reference depth x 0.5/1/1.5 smoke, 2/3..4/3 tiny, "
                         "0.75..1.5 small)")
    ap.add_argument("--sparsity", default=None, help="sparsity label (default: the ~85 %% column)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("depth_sweep", args)
    cell = exp.base(args.scale, args.sparsity)
    scale, label, ref = cell
    depths = args.depths or sorted({max(2, round(ref.n_layer * f)) for f in DEPTH_FACTORS[args.preset]})
    for P in depths:
        pair = depth_pair(ref, P, exp.ctx, budget.preset_search(exp.plan.ladder))
        for arch, cfg in zip(("baseline", "looped"), pair):
            row = exp.add(f"{arch}_L{P}", cfg, common.cell_meta(cell, arch),
                          {"arch": arch, "physical_layers": P, "head_dim": cfg.hd, "n_head": cfg.n_head}, ref)
            row["matched"] = budget.within_tolerance(row["flops_ratio"], row["params_ratio"], row["kv_ratio"])
    rows = exp.train_rows()
    by_arch = {a: [r for r in rows if r["arch"] == a] for a in ("baseline", "looped")}
    series = {a: ([r["effective_layers"] for r in rs], [r["val_loss"] for r in rs]) for a, rs in by_arch.items()}
    fig = common.plot_lines(exp.out / "depth_sweep.png", series, "effective depth (executed layers)",
                            "validation loss", f"Depth sweep at matched budgets ({scale}, {label})")
    best = {a: min(rs, key=lambda r: r["val_loss"])["physical_layers"] for a, rs in by_arch.items()}
    return exp.finish({"reference": ref.to_dict(), "rows": rows, "best_physical_depth": best, "figures": [fig]}, [
        ("arch", "arch", ""), ("physical", "physical_layers", "d"), ("effective", "effective_layers", "d"),
        ("D", "d_model", "d"), ("heads", "n_head", "d"), ("hd", "head_dim", "d"), ("E", "n_experts", "d"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("matched", "matched", ""), ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    checks.run_main(main)
