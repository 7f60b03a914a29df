"""Can a preset's grid decide its scaling claims? Simulated fits on its shape (SMELT 4.2-4.3).

  python scripts/grid_power.py --preset small [--noise 0.002 0.003 0.005] [--seeds 12] [--boot N]
      [--n-scales N] [--sparsities S ...] [--F-span X] [--horizons D ...]   (flags override the preset's shape)

The shape: the preset's fitted cells (scales, sparsity columns), the F span of their matched models and
the endpoints' D as fractions of the longest. SMELT's two Table 4.3 surfaces are drawn on it with log-normal
noise and fitted (scaling.calibrate_rules): how often both fits are identified, and the CE gain's error at
S = 0.95; --boot N also runs scaling_analysis.analyse and the report's CE-gain verdict. Trains nothing; a
geometric proxy, not a forecast of our losses (docs/scripts.md, docs/scaling.md).
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

import statistics
import tempfile
import warnings

import numpy as np

import budget
import checks
import configs
import reproduce
import scaling
from lab import report, scaling_analysis


def preset_shape(preset: str) -> dict:
    """scaling_analysis.design_shape of `preset`'s plan, its ladder matched at the block size (no data needed)."""
    plan = configs.PLANS[preset]
    cells = budget.ladder_cells(plan.ladder, float(plan.block_size), spec=plan.loop)
    return scaling_analysis.design_shape(plan, reproduce.plan_cells(plan, cells))


def analysed(F_span: float, grid: dict, noise: float, seed: int, n_boot: int) -> str:
    """The report's CE-gain verdict on one simulated dataset (the one calibrate_rules fits for this seed)."""
    rows = []
    for arch, p in scaling.paper_pair(F_span, 1.0, noise, seed, grid).items():
        rows += [dict(arch=arch, scale=cell.split("/")[0], sparsity_label=f"S~{round(100 * S)}%", F=float(F), S=float(S),
                      D=float(D), val_loss=float(L), val_loss_by_source={"all": float(L)})
                 for F, S, D, L, cell in zip(p.F, p.S, p.D, p.L, p.cell)]
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = scaling_analysis.analyse(rows, out, n_boot=n_boot, n_jobs=1, seed=seed)
    return report._ce_gain_claim(rep)[-1]


def build_parser():
    ap = common.parser(__doc__, training=False)
    ap.add_argument("--noise", type=checks.positive_float, nargs="+", default=[0.002, 0.003, 0.005],
                    help="log-normal noise of each simulated loss")
    ap.add_argument("--seeds", type=checks.positive_int, default=12, help="simulated datasets per noise level")
    ap.add_argument("--boot", type=checks.nonneg_int, default=0, help="cell-bootstrap draws of the whole analysis (0: fits only)")
    ap.add_argument("--n-scales", type=checks.positive_int, default=None, help="scales (default: the preset's fitted cells')")
    ap.add_argument("--sparsities", type=checks.positive_float, nargs="+", default=None,
                    help="sparse columns' S (default: the preset's)")
    ap.add_argument("--F-span", type=checks.positive_float, default=None, help="largest / smallest F (default: the preset's)")
    ap.add_argument("--horizons", type=checks.positive_float, nargs="+", default=None,
                    help="endpoints' D in any unit, divided by the largest (default: the plan's branch + decay steps)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if any(S >= 1 for S in args.sparsities or ()):
        raise checks.UserError(f"--sparsities: each S must be below 1 (a fraction, 0.95 for S~95 %), got {args.sparsities}")
    exp = common.Experiment("grid_power", args)
    shape = preset_shape(args.preset)
    shape.update({k: getattr(args, k) for k in ("n_scales", "sparsities", "F_span", "horizons") if getattr(args, k)})
    shape = scaling_analysis.grid_totals(shape)
    D_span = shape["D_span"]
    common.log(f"{shape['n_scales']} scales x sparsities {shape['sparsities']}, F span {shape['F_span']:.2f}, endpoints "
               f"at D fractions {[round(h, 3) for h in shape['horizons']]} (D span {D_span:.1f})")
    grid = {k: shape[k] for k in ("n_scales", "sparsities", "horizons")}
    rows = []
    for noise in args.noise:
        res = scaling.calibrate_rules(F_spans=(shape["F_span"],), D_spans=(D_span,), noises=(noise,), seeds=args.seeds,
                                      grid=grid)
        errs = [r["gain_err_pp"] for r in res if r["identified"] and np.isfinite(r["gain_err_pp"])]
        row = {"noise": noise, "identified": sum(r["identified"] for r in res), "datasets": len(res),
               "median_gain_err_pp": statistics.median(errs) if errs else None}
        if args.boot:
            verdicts = [analysed(shape["F_span"], grid, noise, seed, args.boot) for seed in range(args.seeds)]
            row.update({v.replace(" ", "_"): verdicts.count(v) for v in ("reproduced", "not resolved", "contradicted")})
        rows.append(row)
        common.log(f"noise {noise}: {row}")
    return exp.finish({"shape": shape, "boot": args.boot, "rows": rows}, [
        ("noise", "noise", "g"), ("identified", "identified", "d"), ("of", "datasets", "d"),
        ("median abs. gain error (pp)", "median_gain_err_pp", ".1f"), ("CE gain reproduced", "reproduced", "d"),
        ("not resolved", "not_resolved", "d"), ("contradicted", "contradicted", "d")], trained=False)


if __name__ == "__main__":
    checks.run_main(main)
