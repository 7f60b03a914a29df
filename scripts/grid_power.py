"""Can a preset's grid decide its scaling claims? Simulated fits on its shape (SMELT 4.2-4.3).

  python scripts/grid_power.py --preset fits [--prior measured|paper|FILE] [--seeds 12]
      [--branch-steps B ...] [--decay-steps N]                 (another plan's endpoints: the prior decides)
  python scripts/grid_power.py --preset small --prior paper [--noise 0.002 0.003 0.005] [--boot N]
      [--n-scales N] [--sparsities S ...] [--F-span X] [--horizons D ...]   (flags override the preset's shape)
  python scripts/grid_power.py --save-prior RUN_DIR    (a run's fitted surfaces become the measured prior)

--prior measured (the default): the surfaces a fits run measured at our scale (lab/measured_surfaces.json, its
source printed) are drawn at the plan's own F, S and D with their measured log-noise and refitted: how often each
is identified, a forecast. --prior paper: Table 4.3's surfaces drawn on the plan's shape at the paper's F and D
(scaling.calibrate_rules): a geometric proxy, not a forecast. --boot N also runs the whole analysis on each dataset
with N cell-bootstrap draws and counts the report's CE-gain verdicts.
Trains nothing (docs/scripts.md, docs/plans.md).
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

import statistics
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np

import budget
import checks
import configs
import reproduce
import scaling
from lab import report, scaling_analysis


def preset_shape(preset: str, branch_steps=None, decay_steps=None) -> dict:
    """scaling_analysis.design_shape of `preset`'s plan (its endpoints replaced when given), its ladder matched at
    the block size (no data needed)."""
    plan = configs.PLANS[preset]
    if branch_steps:
        plan = replace(plan, branch_steps=sorted(branch_steps), stable_steps=max(branch_steps))
    if decay_steps:
        plan = replace(plan, decay_steps=decay_steps)
    cells = budget.ladder_cells(plan.ladder, float(plan.block_size), arms=plan.arms)
    return scaling_analysis.design_shape(plan, reproduce.plan_cells(plan, cells))


def save_prior(run_dir: str) -> dict:
    """RUN_DIR/results.jsonl's surfaces, fitted as the run's report fits them, written to
    scaling_analysis.MEASURED_PRIOR; the source names the run (its summary.json: preset, commit, date)."""
    run = Path(run_dir)
    summ = checks.read_hashed_json(run / "summary.json", ("preset", "commit", "date"))
    rows = scaling.read_results(str(run / "results.jsonl"))
    scales = sorted({r["scale"] for r in rows}, key=lambda s: int("".join(filter(str.isdigit, s)) or 0))
    src = (f"the {summ['preset']} preset's run of {len(scales)} cells {scales[0]}-{scales[-1]} at commit "
           f"{summ['commit']}, {summ['date'][:10]}")
    return scaling_analysis.save_prior(scaling_analysis.MEASURED_PRIOR, rows, src)


def analysed(shape: dict, prior: str, noise: float | None, seed: int, n_boot: int) -> str:
    """The report's CE-gain verdict on one simulated dataset: the prior's surfaces drawn as design_power draws them
    (prior "paper": the dataset calibrate_rules fits for this seed), analysed as a run is, with n_boot draws."""
    if prior == "paper":
        grid = {k: shape[k] for k in ("n_scales", "sparsities", "horizons")}
        pts = scaling.paper_pair(shape["F_span"], 1.0, noise, seed, grid)
    else:
        pts = scaling_analysis.prior_points(shape, scaling_analysis.load_prior(
            scaling_analysis.MEASURED_PRIOR if prior == "measured" else prior), noise, seed)
    rows = []
    for arch, p in pts.items():
        for F, S, D, L, cell in zip(p.F, p.S, p.D, p.L, p.cell):
            scale, lab = cell.split("/")                  # a measured cell's label; a paper cell's S as a label
            rows.append(dict(arch=arch, scale=scale, sparsity_label=lab if lab.startswith("S") else f"S~{round(100 * S)}%",
                             F=float(F), S=float(S), D=float(D), val_loss=float(L), val_loss_by_source={"all": float(L)}))
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = scaling_analysis.analyse(rows, out, n_boot=n_boot, n_jobs=1, seed=seed)
    return report._ce_gain_claim(rep)[3]


def build_parser():
    ap = common.parser(__doc__, training=False, presets=tuple(configs.PLANS))
    ap.add_argument("--prior", default="measured",
                    help="measured (lab/measured_surfaces.json), paper (Table 4.3 at the paper's F and D), or a prior file "
                         "(default: measured)")
    ap.add_argument("--save-prior", metavar="RUN_DIR", default=None,
                    help="fit RUN_DIR's results as its report does and write the surfaces as the measured prior, then stop "
                         "(default: none, simulate)")
    ap.add_argument("--noise", type=checks.positive_float, nargs="+", default=None,
                    help="log-normal noise of each simulated loss (default: measured prior, each surface's own; "
                         "paper prior, 0.002 0.003 0.005)")
    ap.add_argument("--seeds", type=checks.positive_int, default=12, help="simulated datasets per noise level")
    ap.add_argument("--boot", type=checks.nonneg_int, default=0,
                    help="cell-bootstrap draws of the whole analysis per dataset, for the CE-gain verdict (0: fits only)")
    ap.add_argument("--branch-steps", type=checks.positive_int, nargs="+", default=None,
                    help="the endpoints' branch steps (default: the plan's; the stable phase ends at the last)")
    ap.add_argument("--decay-steps", type=checks.positive_int, default=None, help="decay steps (default: the plan's)")
    ap.add_argument("--n-scales", type=checks.positive_int, default=None, help="--prior paper: scales (default: the preset's fitted cells')")
    ap.add_argument("--sparsities", type=checks.positive_float, nargs="+", default=None,
                    help="--prior paper: sparse columns' S (default: the preset's)")
    ap.add_argument("--F-span", type=checks.positive_float, default=None, help="--prior paper: largest / smallest F (default: the preset's)")
    ap.add_argument("--horizons", type=checks.positive_float, nargs="+", default=None,
                    help="--prior paper: endpoints' D in any unit, divided by the largest (default: the plan's)")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.save_prior:
        surfaces = save_prior(args.save_prior)
        common.log(f"measured prior written to {scaling_analysis.MEASURED_PRIOR}: {surfaces}")
        return surfaces
    if any(S >= 1 for S in args.sparsities or ()):
        raise checks.UserError(f"--sparsities: each S must be below 1 (a fraction, 0.95 for S~95 %), got {args.sparsities}")
    shape_flags = [f"--{k.replace('_', '-')}" for k in ("n_scales", "sparsities", "F_span", "horizons")
                   if getattr(args, k)]
    if shape_flags and args.prior != "paper":
        ap.error(f"{', '.join(shape_flags)} change the paper prior's abstract shape: use them with --prior paper "
                 "(the measured prior draws the plan's own F, S and D)")
    exp = common.Experiment("grid_power", args)
    shape = preset_shape(args.preset, args.branch_steps, args.decay_steps)
    shape.update({k: getattr(args, k) for k in ("n_scales", "sparsities", "F_span", "horizons") if getattr(args, k)})
    shape = scaling_analysis.grid_totals(shape)
    common.log(f"{shape['n_scales']} scales x sparsities {shape['sparsities']}, F span {shape['F_span']:.2f}, endpoints "
               f"at D fractions {[round(h, 3) for h in shape['horizons']]} (D span {shape['D_span']:.1f})")
    rows = []
    for noise in args.noise or ([0.002, 0.003, 0.005] if args.prior == "paper" else [None]):
        p = scaling_analysis.design_power(shape, noise, args.seeds, args.prior)
        if p["why"]:
            raise checks.UserError(f"no fit can be identified on this grid: {'; '.join(p['why'])}")
        if p["unforecast"]:
            raise checks.UserError(f"no forecast: {p['unforecast']}")
        common.log(f"prior: {p['prior']}")
        measured = ", ".join(f"{a} {v:.4f}" for a, v in p["noise"].items()) if isinstance(p["noise"], dict) else None
        row = {"noise": noise if noise is not None else f"measured ({measured})", "identified": p["identified"],
               "datasets": p["datasets"], **{f"identified_{a}": n for a, n in p["identified_by_arch"].items()}}
        if args.prior == "paper":
            errs = [e for e in p["gain_err_pp"] if np.isfinite(e)]
            row["median_gain_err_pp"] = statistics.median(errs) if errs else None
        if args.boot:
            verdicts = [analysed(shape, args.prior, noise, seed, args.boot) for seed in range(args.seeds)]
            row.update({v.replace(" ", "_"): verdicts.count(v) for v in ("reproduced", "not resolved", "contradicted")})
        rows.append(row)
        common.log(f"noise {row['noise']}: {row}")
    return exp.finish({"shape": shape, "prior": p["prior"], "boot": args.boot, "rows": rows}, [
        ("noise", "noise", ""), ("both identified", "identified", "d"), ("Baseline", "identified_baseline", "d"),
        ("SMELT", "identified_smelt", "d"), ("of", "datasets", "d"),
        ("median abs. gain error (pp)", "median_gain_err_pp", ".1f"), ("CE gain reproduced", "reproduced", "d"),
        ("not resolved", "not_resolved", "d"), ("contradicted", "contradicted", "d")], trained=False)


if __name__ == "__main__":
    checks.run_main(main)
