"""SMELT Table 3.4: physical depth, for the Baseline and the looped model, on one budget.

  python scripts/depth_sweep.py --preset smoke|tiny|small [--depths 4 6 8] [--scale S] [--sparsity LABEL]

The reference is the preset Baseline (physical depth L). At every physical depth P both
architectures are re-matched to the reference's FLOPs, parameters and KV cache:
  Baseline at P  d_model near x sqrt(L/P) (FLOPs grow with depth x width^2), head_dim x L/P (KV
                 grows with depth x head width), query heads at the reference's query width per
                 d_model, experts re-solved for total parameters; of the d_model candidates the one
                 with the smallest worst mismatch in the matcher's bands (budget.mismatch) is kept.
  looped at P    budget.match of SMELT's loop (middle half, twice) against that depth-P Baseline.
budget.match keeps the base's depth, so the depth-P Baseline is built here first; the table
reports every run's FLOPs / parameter / KV ratios to the reference and whether they lie in the
matcher's bands ("matched", budget.within_tolerance), so any residual mismatch is visible (at tiny
widths few depths can be matched: d_model moves in steps of 4). Writes results.json, a table and depth_sweep.png
(validation loss against effective depth).
"""
from __future__ import annotations

import math
from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

import budget
import cli
from model import ModelConfig

DEPTH_FACTORS = {"smoke": (0.5, 1.0, 1.5), "tiny": (2 / 3, 1.0, 4 / 3), "small": (0.75, 1.0, 1.25, 1.5)}


def at_depth(ref: ModelConfig, P: int, ctx: int, multiple: int = 4) -> ModelConfig:
    """The unlooped config of physical depth P closest to ref's budgets (see the module docstring)."""
    if P == ref.n_layer:
        return ref
    F_ref, N_ref = budget.flops_per_token(ref, ctx), budget.count_params(ref)["blocks"]
    hd = max(2, round(ref.hd * ref.n_layer / P / 2) * 2)
    q_per_d = ref.n_head * ref.hd / ref.d_model

    def build(d: int) -> ModelConfig:
        n_head = max(1, round(q_per_d * d / hd / ref.n_kv_head)) * ref.n_kv_head
        ff = max(multiple, round(ref.d_ff * d / ref.d_model / multiple) * multiple)
        cfg = replace(ref, n_layer=P, d_model=d, head_dim=hd, n_head=n_head, d_ff=ff)
        if ref.n_experts:   # total parameters are linear in the expert count
            k = ref.top_k
            n0, n1 = (budget.count_params(replace(cfg, n_experts=e))["blocks"] for e in (k, k + 1))
            cfg = replace(cfg, n_experts=max(k, round(k + (N_ref - n0) / (n1 - n0))))
        return cfg

    center = ref.d_model * math.sqrt(ref.n_layer / P)
    ds = range(max(multiple, int(0.7 * center) // multiple * multiple), int(1.3 * center) + multiple, multiple)
    kv_ref = budget.kv_bytes_per_token(ref)

    def worst(c: ModelConfig) -> float:   # the matcher's objective: the worst ratio in half-bands (budget.mismatch)
        return float(budget.mismatch(budget.flops_per_token(c, ctx) / F_ref, budget.count_params(c)["blocks"] / N_ref,
                                     budget.kv_bytes_per_token(c) / kv_ref))
    return min((build(d) for d in ds), key=worst)


def build_parser():
    ap = common.parser(__doc__)
    ap.add_argument("--depths", type=cli.positive_int, nargs="+", default=None,
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
        base = at_depth(ref, P, exp.ctx)
        looped, _ = exp.match(base, budget.smelt_loop(P))
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
    main()
