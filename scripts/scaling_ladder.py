"""SMELT Section 4: the preset's Baseline / SMELT ladder, trained with decay branches, and the scaling fits.

  python scripts/scaling_ladder.py --preset smoke|tiny|small [--steps N] [--scales K] [--bootstrap B]

reproduce.py's stages at a script's length (--steps stable steps per run, decay branches at the plan's
fractions of it); downstream.py and probe_runs.py take its output folder as --ladder.
"""
from __future__ import annotations

from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
import reproduce
from lab import train_plots


def build_parser():
    ap = common.parser(__doc__)
    ap.add_argument("--scales", type=checks.positive_int, default=None, help="keep only the first K scales of the ladder (default: all)")
    ap.add_argument("--bootstrap", type=checks.nonneg_int, default=None, help="cell-bootstrap draws (default: the plan's)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("scaling_ladder", args)
    p, frac = exp.plan, exp.steps / exp.plan.stable_steps
    plan = replace(p, stable_steps=exp.steps, warmup_steps=exp.tc.warmup_steps, decay_steps=exp.tc.decay_steps,
                   branch_steps=sorted({min(exp.steps, max(1, round(b * frac))) for b in p.branch_steps}),
                   eval_tokens=exp.tc.eval_tokens, scales=args.scales or p.scales,
                   bootstrap=p.bootstrap if args.bootstrap is None else args.bootstrap)
    data = exp.load_data()
    ladder = reproduce.stage_ladder(plan, data, exp.out)
    results = reproduce.stage_train(plan, ladder, data, exp.out, exp.jobs)
    train_plots.plot_curves(exp.out, ladder)
    scal = reproduce.stage_scaling(plan, results, exp.out)
    rows = []
    for cell in ladder:
        key, m = (cell["scale"], cell["sparsity_label"]), cell["match"]["smelt"]
        b, s = (max((r for r in results if (r["scale"], r["sparsity_label"], r["arch"]) == (*key, arch)),
                    key=lambda r: r["D"]) for arch in ("baseline", "smelt"))
        rows.append({"scale": cell["scale"], "sparsity_label": cell["sparsity_label"], "S": b["S"],
                     "baseline_val_loss": b["val_loss"], "smelt_val_loss": s["val_loss"],
                     "delta": s["val_loss"] - b["val_loss"], "flops_ratio": m["flops_ratio"],
                     "params_ratio": m["params_ratio"], "kv_ratio": m["kv_ratio"]})
    wins = sum(r["delta"] < 0 for r in rows)
    print(f"SMELT below its Baseline in {wins}/{len(rows)} cells")
    if "error" not in scal:
        print((exp.out / "scaling" / "tables.md").read_text())
    return exp.finish({"plan": {"stable_steps": plan.stable_steps, "branch_steps": plan.branch_steps,
                                "decay_steps": plan.decay_steps, "scales": plan.scales, "bootstrap": plan.bootstrap},
                       "rows": rows, "smelt_wins": wins, "points": len(results), "scaling": scal,
                       "figures": [str(exp.out / "figures" / "curves.png")]}, [
        ("scale", "scale", ""), ("S label", "sparsity_label", ""), ("S", "S", ".3f"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("Baseline", "baseline_val_loss", ".4f"), ("SMELT", "smelt_val_loss", ".4f"),
        ("SMELT - Base", "delta", "+.4f")])


if __name__ == "__main__":
    checks.run_main(main)
