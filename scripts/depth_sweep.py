"""SMELT Table 3.4: physical depth, for the Baseline and the looped model, on one budget.

  python scripts/depth_sweep.py --preset smoke|tiny|small [--depths 4 6 8] [--scale S] [--sparsity LABEL]

The reference is the preset Baseline (physical depth L) and its ladder SMELT. At every other
physical depth P both architectures are matched to the reference's FLOPs, parameters and KV cache
by budget.match with target=ref (the preset's search options, head_dim and KV heads searched wide):
  Baseline at P  unlooped, the search centred on d_model x sqrt(L/P) (FLOPs grow with depth x
                 width^2), head_dim x L/P (KV grows with depth x head width), the reference's
                 proportions of query width and d_ff to d_model; experts solved for parameters.
  looped at P    SMELT's loop (middle half, twice), the search centred on that Baseline.
The table reports every run's FLOPs / parameter / KV ratios to the reference and whether they lie
in the matcher's bands ("matched", budget.within_tolerance), so a depth that cannot be matched is
visible (small P = 9 looped: no head_dim multiple of 8 meets its KV). Writes results.json, a table and
depth_sweep.png (validation loss against effective depth).
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


def at_depth(ref: ModelConfig, P: int, ctx: float, **search) -> ModelConfig:
    """The unlooped config of physical depth P != ref.n_layer matched to ref's budgets (module docstring)."""
    d = max(4, round(ref.d_model * math.sqrt(ref.n_layer / P) / 4) * 4)   # FLOPs ~ depth x width^2
    hd = max(2, round(ref.hd * ref.n_layer / P / 2) * 2)                   # KV ~ depth x head width
    center = replace(ref, n_layer=P, d_model=d, head_dim=hd, d_ff=max(4, round(ref.d_ff * d / ref.d_model / 4) * 4),
                     n_head=max(1, round(ref.n_head * ref.hd * d / ref.d_model / hd / ref.n_kv_head)) * ref.n_kv_head)
    return budget.match(center, LoopConfig(), ctx, target=ref, **{**search, **heads_search(ref), "d_range": (0.75, 1.25)})[0]


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
        base = at_depth(ref, P, ctx, **search)
        return base, budget.match(base, SMELT.at(P), ctx, target=ref, **{**search, **heads_search(ref)})[0]


def build_parser():
    ap = common.parser(__doc__)
    ap.add_argument("--depths", type=checks.positive_int, nargs="+", default=None,
                    help="physical depths (default: the reference depth x 0.5/1/1.5 smoke, 2/3..4/3 tiny, "
                         "0.75..1.5 small)")
    ap.add_argument("--scale", default=None, help="preset scale of the reference (default: the deepest)")
    ap.add_argument("--sparsity", default=None, help="sparsity label (default: the ~85 %% column)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("depth_sweep", args)
    scale, label, ref = exp.base(args.scale, args.sparsity)
    control = budget.dense_control(ref)
    depths = args.depths or sorted({max(2, round(ref.n_layer * f)) for f in DEPTH_FACTORS[args.preset]})
    specs, info = [], []
    for P in depths:
        base, looped = depth_pair(ref, P, exp.ctx, budget.preset_search(exp.plan.ladder))
        for arch, cfg in (("baseline", base), ("looped", looped)):
            specs.append((f"{arch}_L{P}", cfg, {"control": control, "scale": scale, "sparsity_label": label,
                                                "arch": arch}))
            b = exp.budgets(cfg, ref)
            info.append({"arch": arch, "physical_layers": P, "head_dim": cfg.hd, "n_head": cfg.n_head, **b,
                         "matched": budget.within_tolerance(b["flops_ratio"], b["params_ratio"], b["kv_ratio"])})
    rows = [{**i, **r} for i, r in zip(info, exp.train_all(specs))]
    series = {arch: ([r["effective_layers"] for r in rows if r["arch"] == arch],
                     [r["val_loss"] for r in rows if r["arch"] == arch]) for arch in ("baseline", "looped")}
    fig = common.plot_lines(exp.out / "depth_sweep.png", series, "effective depth (executed layers)",
                            "validation loss", f"Depth sweep at matched budgets ({scale}, {label})")
    best = {a: min((r for r in rows if r["arch"] == a), key=lambda r: r["val_loss"])["physical_layers"]
            for a in series}
    return exp.finish({"reference": ref.to_dict(), "rows": rows, "best_physical_depth": best, "figures": [fig]}, [
        ("arch", "arch", ""), ("physical", "physical_layers", "d"), ("effective", "effective_layers", "d"),
        ("D", "d_model", "d"), ("heads", "n_head", "d"), ("hd", "head_dim", "d"), ("E", "n_experts", "d"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("matched", "matched", ""), ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    checks.run_main(main)
