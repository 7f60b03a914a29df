"""From train.py's results rows to the scaling report (SMELT Sections 4.3 and 5.2).

`analyse` (reproduce.stage_scaling; `python -m lab.scaling_analysis --results results.jsonl`, or `--paper`):
one Eq. 2 surface per architecture over the cells both have, S = 0 controls left out, and only from identified
fits the CE gain and TPP at `preset_budgets` or the data's compute window (`gain_cell` flags extrapolation),
`cell_bootstrap` brackets (a failed draw counts as -inf / +inf), SMELT 5.2's per-subset intercept fits and
Baseline-loss quartiles.  It writes coeffs.json, tables.json, tables.md and scaling_report.py's figures.

Read first: scaling.py.  The report's keys, and why the budgets, flags and intervals are so: docs/scaling.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

import checks
from lab import scaling_report, stats
from lab.scaling_report import cell_text, markdown, paper_tables, pct_text, tpp_text, why_text
from scaling import (CONTROL_LABEL, GAIN_FLOOR, PAPER_BASELINE, PAPER_BUDGETS, PAPER_CROSSOVER_D, PAPER_SMELT,
                     RULES, Coeffs, FitResult, Points, Rules, ce_gain, cell_id, check_budget, check_rows,
                     data_crossover, data_ranges, fit, fit_result, loss, optimal_flops_per_token, read_results, seed_means,
                     short_num, split_control, subset_points, to_points, tpp)


@dataclass
class Bootstrap:
    gain: np.ndarray | None  # (n_ok, nC, nS) CE gain of target over reference (None: one surface)
    tpp: np.ndarray          # (n_ok, n_surfaces, nS) TPP at tpp_C, [target, reference]
    n_draws: int = 0
    n_failed: int = 0        # failed draws: a refit raised, was not identified, or gave a non-finite number
    failures: dict = field(default_factory=dict)   # "surface: reason key" -> count
    coefs: np.ndarray | None = None   # (n_ok, n_surfaces, 4): each refit's a, c, gamma = ac / (a + c), log10 K
    names: tuple = ()                 # the surfaces' names

    @property
    def failed_share(self) -> float:
        return self.n_failed / self.n_draws if self.n_draws else 1.0

    @staticmethod
    def interval(draws: np.ndarray, level: float = 0.95, n_failed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Percentiles over the refits `draws` and n_failed failed draws counted as -inf / +inf."""
        return stats.percentiles_with_failures(draws, n_failed, level)


def _bootstrap_chunk(args) -> tuple[list, list, list, Counter]:
    """Worker: refit every surface on each resample in `draws` (lists of cell ids); a draw fails if a refit
    raises, is not identified or gives a non-finite gain / TPP."""
    surfaces, names, draws, C, S, tpp_C, init, fit_opts = args
    index = [{c: np.flatnonzero(p.cell == c) for c in set(p.cell)} for p in surfaces]   # cell id -> point indices
    gains, tpps, coefs, failed = [], [], [], Counter()
    for cells in draws:
        fits, reason = [], None
        with warnings.catch_warnings(action="ignore"):       # a weak resample is expected, not news
            for p, idx, co, name in zip(surfaces, index, init, names):
                q = p.take(np.concatenate([idx[c] for c in cells]))
                try:
                    r = fit_result(q.F, q.S, q.D, q.L, init=[co], **fit_opts)
                    pinned = set(r.fixed) != set(fit_opts.get("fixed", {}))     # b pinned: the resample has one S
                    reason = r.why[0].split(":")[0] if r.why else "sparsity range" if pinned else None
                except ValueError as e:
                    reason = f"refit impossible ({str(e).split(':')[0]})"
                if reason is not None:
                    reason = f"{name}: {reason}"
                    break
                fits.append(r.coeffs)
            if reason is None:
                g = ce_gain(fits[0], fits[1], C[:, None], S[None, :]) if len(fits) == 2 else None   # (nC, nS)
                t = np.array([tpp(f, tpp_C, S) for f in fits])                                      # (n_surf, nS)
                if not (np.isfinite(t).all() and (g is None or np.isfinite(g).all())):
                    reason = "non-finite gain or TPP"
        if reason is None:
            gains.append(g); tpps.append(t)
            coefs.append([[f.a, f.c, f.gamma, math.log10(f.K)] for f in fits])
        else:
            failed[reason] += 1
    return gains, tpps, coefs, failed


def cell_bootstrap(target: Points, ref: Points | None, C, S, *, tpp_C: float = 1e21, n_draws: int = 2000,
                   seed: int = 0, n_jobs: int = 2, init: tuple | None = None,
                   names: tuple[str, str] = ("target", "reference"), **fit_opts) -> Bootstrap:
    """SMELT 4.3 brackets: resample grid cells (the same for both surfaces), refit from `init` (default the
    full-data fits), record the CE gain at every (C, S) and the TPP at (tpp_C, S); ref=None: TPP only."""
    if isinstance(n_draws, bool) or not isinstance(n_draws, (int, np.integer)) or n_draws < 1:
        raise ValueError(f"n_draws must be an integer >= 1; got {n_draws!r}")
    surfaces = [target] if ref is None else [target, ref]
    cells = sorted(set(target.cell))
    if ref is not None and set(ref.cell) != set(cells):
        raise ValueError(f"target and reference must cover the same cells; differ in "
                         f"{sorted(set(ref.cell) ^ set(cells))}")
    C, S = (np.atleast_1d(x).astype(float) for x in check_budget(C, S))
    if init is None:
        init = tuple(fit(p.F, p.S, p.D, p.L, fixed=fit_opts.get("fixed")) for p in surfaces)
    fit_opts.setdefault("n_starts", 4)
    rng = np.random.default_rng(seed)
    draws = [[cells[i] for i in rng.integers(0, len(cells), len(cells))] for _ in range(n_draws)]
    chunks = np.array_split(np.arange(n_draws), max(1, min(n_draws, 4 * n_jobs)))     # contiguous: order kept
    args = [(surfaces, names, [draws[i] for i in ch], C, S, tpp_C, init, fit_opts) for ch in chunks]
    if n_jobs > 1:
        with ProcessPoolExecutor(max_workers=n_jobs) as pool:
            parts = list(pool.map(_bootstrap_chunk, args))
    else:
        parts = [_bootstrap_chunk(a) for a in args]
    gains, tpps, coefs = ([x for p in parts for x in p[i]] for i in range(3))
    failures = sum((p[3] for p in parts), Counter())
    n_failed = sum(failures.values())
    if n_failed:
        warnings.warn(f"{n_failed} of {n_draws} bootstrap draws failed to refit to identified surfaces "
                      f"(counted as failures in every interval): {dict(failures)}", stacklevel=2)
    gain = None if ref is None else (np.array(gains) if gains else np.empty((0, len(C), len(S))))
    return Bootstrap(gain, np.array(tpps) if tpps else np.empty((0, len(surfaces), len(S))), n_draws, n_failed,
                     dict(failures), np.array(coefs) if coefs else np.empty((0, len(surfaces), 4)),
                     names[:len(surfaces)])


def fit_subsets(subsets: Mapping[str, Points], shared: Coeffs, **opts) -> dict[str, Coeffs]:
    """Per subset (domain or source), fit only E, A and K, with the aggregate fit's exponents."""
    return {name: _intercept_fit(p, shared, **opts).coeffs for name, p in subsets.items()}


def _intercept_fit(p: Points, shared: Coeffs, **opts) -> FitResult:
    opts.setdefault("n_starts", 4)                    # three free intercepts, started from `shared`: easy
    return fit_result(p.F, p.S, p.D, p.L, fixed={"a": shared.a, "b": shared.b, "c": shared.c}, init=[shared], **opts)


def subset_ce_gains(target: Mapping[str, Coeffs], ref: Mapping[str, Coeffs], C: float,
                    S: float) -> dict[str, float]:
    """CE gain (Eq. 5) per subset in both fits; one without a frontier is left out with a warning."""
    out = {}
    for k in (k for k in target if k in ref):
        try:
            out[k] = float(ce_gain(target[k], ref[k], C, S))
        except ValueError as e:
            warnings.warn(f"CE gain for subset {k!r} left out: {e}")
    return out


def quartile_gains(gain: Mapping[str, float], baseline_losses: Sequence[Mapping[str, float]],
                   n_groups: int = 4) -> np.ndarray:
    """SMELT 5.2: per pair, sources ranked by Baseline loss in n_groups near-equal groups (Q1 lowest); gains
    averaged per group, then over pairs."""
    per_pair = []
    for losses in baseline_losses:
        names = sorted((s for s in losses if s in gain), key=lambda s: losses[s])
        if len(names) < n_groups:
            raise ValueError(f"{len(names)} sources with a gain cannot fill {n_groups} groups")
        per_pair.append([np.mean([gain[s] for s in grp]) for grp in np.array_split(np.array(names), n_groups)])
    if not per_pair:
        raise ValueError("no Baseline per-source losses to rank")
    return np.mean(per_pair, axis=0)


def frontier_extrapolation(co: Coeffs, C: float, S: float, ranges: Mapping, who: str) -> list[str]:
    """Why `co`'s frontier point at budget C extrapolates its data: C, F* or D* outside its C, F or D ranges."""
    out = []
    F = float(optimal_flops_per_token(co, C, S))
    for k, v, name in (("C", C, "budget C"), ("F", F, "optimal F*"), ("D", C / F, "optimal D*")):
        lo, hi = ranges[k]
        if not lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
            out.append(f"{who}: {name} = {short_num(v)} outside its data's {k} ({short_num(lo)} to {short_num(hi)})")
    return out


def gain_cell(target: Coeffs, ref: Coeffs, C: float, S: float, rt: Mapping, rr: Mapping,
              names: tuple[str, str]) -> dict:
    """One CE gain (Eq. 5, None below GAIN_FLOOR) with its C_ref and its extrapolation flags."""
    with warnings.catch_warnings(action="ignore"):
        g = float(ce_gain(target, ref, C, S))
    C_ref = C / (1 - g) if g < 1 else math.inf
    why = frontier_extrapolation(target, C, S, rt, names[0])
    if math.isinf(C_ref):
        why.append(f"{names[1]}: never reaches {names[0]}'s frontier loss (below its floor E)")
    else:
        why += [w.replace("budget C", "C_ref") for w in frontier_extrapolation(ref, C_ref, S, rr, names[1])]
    ok = g >= GAIN_FLOOR
    return {"gain": g if ok else None, "pct": 100 * g if ok else None,
            "C_ref": C_ref if ok and math.isfinite(C_ref) else None,
            "extrapolated": bool(why), "extrapolation": why}


def _interval(point: float | None, draws: np.ndarray, bs: Bootstrap, n_units: int, rules: Rules,
              fraction: bool = True) -> dict:
    """One cell's interval (a stats.Interval dict, failed draws included) or why it has none, and its draws."""
    out = {"interval": None, "interval_why": None, "n_draws": bs.n_draws, "n_failed": bs.n_failed,
           "failed_share": bs.failed_share}
    n_ok = len(draws)
    if point is None:
        out["interval_why"] = "the point estimate lies below -9999 %"
    elif n_ok < rules.min_ok_draws:
        out["interval_why"] = f"only {n_ok} of {bs.n_draws} draws refit to identified surfaces (< {rules.min_ok_draws})"
    elif bs.failed_share > rules.max_failed_share:
        out["interval_why"] = (f"{100 * bs.failed_share:.0f} % of the draws failed (> "
                               f"{100 * rules.max_failed_share:.0f} %): the survivors are a biased subsample")
    else:
        lo, hi = (float(x) for x in Bootstrap.interval(draws, n_failed=bs.n_failed))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            out["interval_why"] = (f"{bs.n_failed} of {bs.n_draws} draws failed ({100 * bs.failed_share:.1f} %); "
                                   f"counted as -inf / +inf the 95 % interval is unbounded")
        elif fraction and lo < GAIN_FLOOR:
            out["interval_why"] = f"lower bound {pct_text(lo)} %: beyond -9999 % the interval carries no information"
        else:
            out["interval"] = stats.Interval(float(point), lo, hi, n_units, 0.95, "cell bootstrap (refit)").to_dict()
    return out


def design_shape(plan, ladder: Sequence[dict]) -> dict:
    """The grid a plan fits (its sparse cells; S = 0 controls are never fitted) with `grid_totals`' spans and points;
    F span: the smallest of its arms' (scripts/grid_power.py, reproduce's plan line). Also each
    arm's F and S per cell and the endpoints' tokens D, as its training rows will record them."""
    import budget
    import configs
    from lab.downstream_claims import label_percent
    from model import ModelConfig
    cells = [c for c in ladder if c["sparsity_label"] != CONTROL_LABEL]
    cfgs = {a: [ModelConfig.from_dict(c[a]) for c in cells] for a in configs.cell_arms(cells[0])}
    F = {a: [budget.flops_per_token(m, c["ctx_len"]) for m, c in zip(cfgs[a], cells)] for a in cfgs}
    ctrl = [budget.dense_control(m) for m in cfgs["baseline"]]          # train.py's S: against the dense control
    S = {a: [budget.config_sparsity(m, c["ctx_len"], k) for m, k, c in zip(cfgs[a], ctrl, cells)] for a in cfgs}
    steps = [b + plan.decay_steps for b in plan.branch_steps]
    return grid_totals(dict(n_scales=len({c["scale"] for c in cells}), F_span=min(max(f) / min(f) for f in F.values()),
                            horizons=steps, sparsities=sorted({label_percent(c["sparsity_label"]) / 100 for c in cells}),
                            F=F, S=S, D=[s * plan.batch_size * plan.block_size for s in steps],
                            cells=[cell_id(c) for c in cells]),
                       n_cells=len(cells))


def grid_totals(shape: dict, n_cells: int | None = None) -> dict:
    """`shape` (n_scales, sparsities, F_span, horizons in any unit) with its horizons as fractions of the longest, its
    D and C spans, cells (default: every scale x sparsity) and distinct points per surface."""
    h = [x / max(shape["horizons"]) for x in shape["horizons"]]
    n = shape["n_scales"] * len(shape["sparsities"]) if n_cells is None else n_cells
    return dict(shape, horizons=h, D_span=1 / min(h), C_span=shape["F_span"] / min(h), n_cells=n, points=n * len(h))


MEASURED_PRIOR = Path(__file__).with_name("measured_surfaces.json")   # the fits run's surfaces (docs/plans.md)


def load_prior(path: str | Path = MEASURED_PRIOR) -> dict:
    """{"source", "surfaces": {arch: (Coeffs, log-noise)}, "why": {arch: [...]}, "pinned": {arch: [...]}} from a
    prior file (save_prior); "why": a best fit `identify` did not accept; "pinned": coefficients fit_result fixed."""
    s = (d := checks.read_hashed_json(Path(path), ("source", "surfaces")))["surfaces"]
    return {"source": d["source"], "why": {a: v["why"] for a, v in s.items()},
            "pinned": {a: v.get("pinned", []) for a, v in s.items()},
            "surfaces": {a: (Coeffs(**{k: v[k] for k in "EAKabc"}), float(v["log_noise"])) for a, v in s.items()}}


def save_prior(path: str | Path, rows: Sequence[dict], source: str) -> dict:
    """Fit each architecture's rows as analyse does and write the surfaces with their log-noise (the RMS of the log
    residuals) as a prior for design_power: a forecast needs the best estimate of our surface, so one that is not
    identified is kept, with its reasons (a prior, never a reported result)."""
    g = _group(seed_means(rows), False, "smelt", "baseline")
    _fit_all(g, RULES)
    if missing := [a for a in g.archs if a not in g.results]:
        raise ValueError(f"no surface to save for {', '.join(missing)}: {'; '.join(w for a in missing for w in g.why[a])}")
    surfaces = {}
    for a, res in sorted(g.results.items()):
        p, co = g.pts[a], res.coeffs
        noise = float(np.sqrt(np.mean((np.log(loss(co, p.F, p.S, p.D)) - np.log(p.L)) ** 2)))
        surfaces[a] = {**asdict(co), "log_noise": noise, "why": list(g.why[a]), "pinned": sorted(res.fixed)}
    checks.write_json(Path(path), {"source": source, "surfaces": surfaces})
    return surfaces


def design_power(shape: Mapping, noise: float | None = None, seeds: int = 8, prior: str | Path = "measured") -> dict:
    """How often each surface refits identified when drawn on `shape` with log-normal noise. prior "measured" (or a
    prior file): surfaces measured at our scale (load_prior), drawn at the plan's own F, S and D with each one's
    measured noise (`noise` overrides it): a forecast of what a run will identify. "paper": Table 4.3's surfaces at
    the paper's F and D (scaling.calibrate_rules, noise 0.005): a geometric proxy only. "unforecast": why a
    measured prior cannot forecast this grid (it pinned b, the grid varies S), else None."""
    from scaling import calibrate_rules, data_checks
    S = shape["sparsities"]
    b_free = len(S) > 1                                   # one sparsity: b is pinned to 0 (_fit_all)
    spans = {"C": shape["C_span"], "F": shape["F_span"], "D": shape["D_span"], "one_minus_S": (1 - min(S)) / (1 - max(S))}
    why = data_checks(shape["points"], 6 - (not b_free), spans, b_free)
    out = {"prior": "Table 4.3 at the paper's F and D" if prior == "paper" else None, "noise": noise,
           "datasets": 0, "identified": 0, "identified_by_arch": {}, "why": why, "unforecast": None}
    if why:                                               # the data rules fail on any surface: nothing to simulate
        return out
    if prior == "paper":
        noise = 0.005 if noise is None else noise
        grid = {k: shape[k] for k in ("n_scales", "sparsities", "horizons")}
        res = calibrate_rules(F_spans=(shape["F_span"],), D_spans=(shape["D_span"],), noises=(noise,), seeds=seeds,
                              grid=grid)
        return dict(out, noise=noise, datasets=len(res), identified=sum(r["identified"] for r in res),
                    gain_err_pp=[r["gain_err_pp"] for r in res if r["identified"]])   # CE gain at S = 0.95 vs truth
    pr = load_prior(MEASURED_PRIOR if prior == "measured" else prior)
    weak = [a for a, w in pr["why"].items() if w]
    src = f"measured: {pr['source']}" + (f" ({', '.join(weak)}: a best fit that is not identified)" if weak else "")
    if b_free and (blind := [a for a, p in sorted(pr["pinned"].items()) if "b" in p and a in shape["F"]]):
        return dict(out, prior=src, unforecast=f"the measured {' and '.join(blind)} pinned b (fitted on one "
                    f"sparsity): no measure of how the loss moves with S, which this grid varies ({len(S)} "
                    f"sparsities); the geometric proxy instead: scripts/grid_power.py --prior paper")
    hits = {a: [] for a in pr["surfaces"]}
    for seed in range(seeds):
        for a, p in prior_points(shape, pr, noise, seed).items():
            with warnings.catch_warnings(action="ignore"):
                hits[a].append(fit_result(p.F, p.S, p.D, p.L, fixed={} if b_free else {"b": 0.0}, n_starts=8).identified)
    return dict(out, prior=src, noise={a: sd if noise is None else noise for a, (_, sd) in pr["surfaces"].items()},
                datasets=seeds, identified=int(sum(all(h) for h in zip(*hits.values()))),
                identified_by_arch={a: int(sum(h)) for a, h in hits.items()})


def prior_points(shape: Mapping, prior: dict, noise: float | None = None, seed: int = 0) -> dict[str, Points]:
    """Each prior surface (load_prior) drawn at `shape`'s own F and S per cell and D per endpoint, with log-normal
    noise (its measured one unless `noise`), one independent draw per surface and seed; a surface of an arm the
    plan does not have is not drawn."""
    D, out = np.asarray(shape["D"], dtype=float), {}
    for k, (a, (co, sd)) in enumerate(sorted(prior["surfaces"].items())):
        if a not in shape["F"]:
            continue
        rng = np.random.default_rng([seed, k])
        F, S = (np.repeat(np.asarray(shape[x][a], dtype=float), len(D)) for x in ("F", "S"))
        Da = np.tile(D, len(shape["F"][a]))
        L = loss(co, F, S, Da) * np.exp((sd if noise is None else noise) * rng.standard_normal(len(F)))
        out[a] = Points(F, S, Da, L, np.repeat(shape["cells"], len(D)))
    return out


@dataclass
class _Grid:
    """analyse's rows per architecture (only the cells both target and ref have), then their fits."""
    archs: list                 # every architecture in the rows, control cells included
    by_arch: dict               # arch -> rows to fit
    pts: dict                   # arch -> Points to fit (archs with rows only)
    control: dict               # arch -> Points of its control cells (drawn, never fitted)
    cols: dict                  # sparsity label -> mean measured S (the table columns, by S)
    S: np.ndarray               # cols' values
    n_control_rows: int
    had_rows: set               # archs with rows to fit before the cells were matched
    unmatched: list             # cells only one of target / ref has (left out)
    pair: bool                  # both target and ref have rows
    names: tuple = ()           # (target, ref)
    rules: Rules = RULES
    results: dict = field(default_factory=dict)   # arch -> FitResult (_fit_all)
    why: dict = field(default_factory=dict)       # arch -> reasons its fit is not identified ([] if it is)
    fits: dict = field(default_factory=dict)      # identified arch -> Coeffs

    @property
    def both(self) -> bool:
        """Both target and ref have rows and identified fits: CE gains can be computed."""
        return self.pair and all(a in self.fits for a in self.names)

    def n_cells(self, arch: str) -> int:
        return len(set(self.pts[arch].cell))

    def pair_gain(self, C: float, S: float) -> dict:
        (t, r), rs = self.names, self.results
        return gain_cell(self.fits[t], self.fits[r], C, S, rs[t].ranges, rs[r].ranges, self.names)


def _group(rows: Sequence[dict], include_dense: bool, target: str, ref: str) -> _Grid:
    """Split off the control cells, keep the cells both target and ref have, and make Points."""
    fit_rows, control_rows = split_control(rows, include_dense)
    archs = sorted({r["arch"] for r in fit_rows} | {r["arch"] for r in control_rows})
    by_arch = {a: [r for r in fit_rows if r["arch"] == a] for a in archs}
    unmatched = []
    pair = target in archs and ref in archs
    if pair:                                                # CE gains compare cells both archs have
        ct, cr = ({cell_id(r) for r in by_arch[a]} for a in (target, ref))
        unmatched = sorted(ct ^ cr)
        for a in (target, ref):
            by_arch[a] = [r for r in by_arch[a] if cell_id(r) in ct & cr]
    pts = {a: to_points(rs) for a, rs in by_arch.items() if rs}
    control = {a: to_points(rs) for a in archs if (rs := [r for r in control_rows if r["arch"] == a])}
    by_label: dict[str, list] = defaultdict(list)
    for r in (r for rs in by_arch.values() for r in rs):
        by_label[str(r["sparsity_label"])].append(max(float(r["S"]), 0.0))
    cols = dict(sorted(((k, float(np.mean(v))) for k, v in by_label.items()), key=lambda kv: kv[1]))
    return _Grid(archs, by_arch, pts, control, cols, np.array(list(cols.values())), len(control_rows),
                 {r["arch"] for r in fit_rows}, unmatched, pair, (target, ref))


def _fit_all(g: _Grid, rules: Rules) -> None:
    """Fit each architecture (b pinned to 0 when it has one sparsity label) into g.results, g.why and g.fits."""
    g.rules = rules
    for a in g.archs:
        p = g.pts.get(a)
        if p is None:
            other = g.names[1] if a == g.names[0] else g.names[0]
            g.why[a] = [f"no rows to fit: no cell shared with {other}" if a in g.had_rows else
                        f"no rows to fit: only {CONTROL_LABEL} control cells" if a in g.control else "no rows to fit"]
            continue
        fixed = {"b": 0.0} if len({r["sparsity_label"] for r in g.by_arch[a]}) == 1 else {}
        try:
            with warnings.catch_warnings(action="ignore"):
                g.results[a] = fit_result(p.F, p.S, p.D, p.L, fixed=fixed, rules=rules)
            g.why[a] = g.results[a].why
        except ValueError as e:
            g.why[a] = [f"fit impossible: {e}"]
    g.fits = {a: r.coeffs for a, r in g.results.items() if not g.why[a]}


def _fit_entry(g: _Grid, a: str) -> dict:
    """What the report may print about one architecture: data facts always, coefficients only when identified."""
    res, p, why = g.results.get(a), g.pts.get(a), g.why[a]
    e = {"identified": res is not None and not why, "why": list(why),
         "n_points": res.n_points if res is not None else 0 if p is None else len(p.L),
         "cells": sorted({cell_id(r) for r in g.by_arch[a]})}
    if p is not None:
        e["ranges"] = {k: list(v) for k, v in data_ranges(p.F, p.S, p.D).items()}
    if e["identified"]:
        co = res.coeffs
        e.update(asdict(co), se=dict(res.se), gamma=co.gamma, rmse_nats=res.rmse,
                 objective=res.objective, converged=res.converged, fixed=dict(res.fixed))
    return e


def preset_budgets(ladder: str) -> tuple[float, ...] | None:
    """Table 4.3's budgets for the paper ladder; None (the data's own compute window, `_budgets`) otherwise."""
    return PAPER_BUDGETS if ladder == "paper" else None


BUDGET_RULES = {"data": "in-window: the 25 / 50 / 75 % points of log C over the compute window both architectures' "
                        "data span (the paper's 1e20-1e22 lie outside a reduced preset's data)",
                "given": "given budgets (the paper preset: Table 4.3's 1e20, 1e21 and 1e22 FLOPs); one outside "
                         "the data is marked extrapolated (†)"}


def _budgets(g: _Grid, budgets: Sequence[float] | None) -> dict:
    """The CE-gain budgets: given, or the log-quartiles of the data's compute window (the overlap of the two
    architectures' C ranges); TPP at the middle one."""
    Cs = [g.pts[a].F * g.pts[a].D for a in (g.names if g.pair else g.archs) if a in g.pts]
    lo, hi = max((float(C.min()) for C in Cs), default=math.inf), min((float(C.max()) for C in Cs), default=0.0)
    window = (lo, hi) if lo <= hi else None
    if budgets is None:
        source = "data"
        budgets = [] if window is None else [window[0] ** 0.75 * window[1] ** 0.25, math.sqrt(window[0] * window[1]),
                                             window[0] ** 0.25 * window[1] ** 0.75]
    else:
        source = "given"
        budgets = [float(b) for b in budgets]
        if not budgets or not all(math.isfinite(b) and b > 0 for b in budgets):
            raise ValueError(f"budgets must be positive finite FLOPs; got {budgets}")
    budgets = sorted(budgets)
    tpp_C = budgets[len(budgets) // 2] if budgets else None
    return dict(budgets=budgets, budget_source=source, budget_rule=BUDGET_RULES[source],
                compute_window=None if window is None else list(window), tpp_budget=tpp_C)


def _bootstraps(g: _Grid, budgets: list, Cgrid: np.ndarray, tpp_C: float | None, n_boot: int, seed: int,
                n_jobs: int) -> dict[str, Bootstrap]:
    """Cell bootstraps: "pair" when both surfaces are identified, and each other identified surface alone."""
    boots = {}
    if n_boot > 0 and budgets and g.cols:
        alone = [(a, (a,)) for a in sorted(g.fits) if not (g.both and a in g.names)]
        for key, archs in ([("pair", g.names)] if g.both else []) + alone:
            p = [g.pts[a] for a in archs]
            boots[key] = cell_bootstrap(p[0], p[1] if len(p) == 2 else None, np.concatenate([budgets, Cgrid]), g.S,
                                        tpp_C=tpp_C, n_draws=n_boot, seed=seed, n_jobs=n_jobs, rules=g.rules,
                                        init=tuple(g.fits[a] for a in archs), names=archs,
                                        fixed=g.results[archs[0]].fixed)
    return boots


def _gain_cells(g: _Grid, budgets: list, boots: dict, no_boot: dict) -> dict:
    """report["gains"]: the CE gain (Eq. 5) at every (budget, sparsity column) with its interval."""
    target, ref = g.names
    gains = {"available": False, "why": [], "target": target, "ref": ref, "cells": []}
    if not g.pair:
        gains["why"] = [f"needs rows of both {target!r} and {ref!r}"]
    elif not g.both:
        gains["why"] = [f"{a} {why_text(g.why[a])}" for a in g.names if a not in g.fits]
    elif not budgets:
        gains["why"] = ["the two architectures' compute ranges do not overlap: no budget inside both"]
    else:
        gains["available"] = True
        bs = boots.get("pair")
        for i, C in enumerate(budgets):
            for j, (lab, s) in enumerate(g.cols.items()):
                cell = {"budget": C, "sparsity_label": lab, "S": s, **g.pair_gain(C, s)}
                cell.update(no_boot if bs is None else
                            _interval(cell["gain"], bs.gain[:, i, j], bs, g.n_cells(target), g.rules))
                cell["text"] = cell_text(pct_text, cell["gain"], cell)
                gains["cells"].append(cell)
    return gains


def _tpp_cells(g: _Grid, a: str, tpp_C: float | None, boots: dict, no_boot: dict) -> dict:
    """report["tpp"][a]: TPP of one architecture at the middle budget, per sparsity column."""
    t = {"available": False, "why": [], "budget": tpp_C, "cells": []}
    if a not in g.fits:
        t["why"] = [why_text(g.why[a])]
    elif tpp_C is None:
        t["why"] = ["no budget inside the data"]
    else:
        t["available"] = True
        bs = next((b for b in boots.values() if a in b.names), None)      # the pair's, its own, or none
        for j, (lab, s) in enumerate(g.cols.items()):
            v = float(tpp(g.fits[a], tpp_C, s))
            cell = {"sparsity_label": lab, "S": s, "tpp": v,
                    "extrapolation": frontier_extrapolation(g.fits[a], tpp_C, s, g.results[a].ranges, a)}
            cell["extrapolated"] = bool(cell["extrapolation"])
            cell.update(no_boot if bs is None else _interval(v, bs.tpp[:, bs.names.index(a), j], bs, g.n_cells(a),
                                                             g.rules, fraction=False))
            cell["text"] = cell_text(tpp_text, v, cell)
            t["cells"].append(cell)
    return t


def _gain_curve(g: _Grid, Cgrid: np.ndarray, boots: dict, n_budgets: int) -> dict:
    """ce_gain.png's data: the CE gain in % along Cgrid per column, its extrapolation flags and the
    bootstrap band when the pair bootstrap has enough draws."""
    cells = [[g.pair_gain(C, s) for s in g.S] for C in Cgrid]
    pct = np.array([[np.nan if c["gain"] is None else 100 * c["gain"] for c in row] for row in cells])
    gain_plot = {"C": Cgrid, "pct": pct, "extrapolated": np.array([[c["extrapolated"] for c in row] for row in cells])}
    bs = boots.get("pair")
    if bs is not None and len(bs.gain) >= g.rules.min_ok_draws and bs.failed_share <= g.rules.max_failed_share:
        lo, hi = Bootstrap.interval(bs.gain[:, n_budgets:, :], n_failed=bs.n_failed)
        if np.isfinite(lo).all() and np.isfinite(hi).all():       # failures past 2.5 %: no band to draw
            gain_plot.update(band=(100 * lo, 100 * hi), failed_share=bs.failed_share)
    return gain_plot


def _derived(g: _Grid, gains: dict, budgets: list, tpp_C, boots: dict) -> dict:
    """SMELT 4.3's further claims from the pair bootstrap: target - ref in a, c and gamma; the CE gain's growth
    in pp per decade between the first and last in-window budget and TPP_target / TPP_ref, per column."""
    if "pair" not in boots or not gains.get("available"):
        return {}
    bs, (ft, fr) = boots["pair"], (g.fits[a] for a in g.names)

    def claim(point: float, draws: np.ndarray, **extra) -> dict:
        return {"point": point, **extra, **_interval(point, draws, bs, g.n_cells(g.names[0]), g.rules, fraction=False)}

    out = {f"{k}_diff": claim(getattr(ft, k) - getattr(fr, k), bs.coefs[:, 0, i] - bs.coefs[:, 1, i])
           for i, k in enumerate(("a", "c", "gamma"))}
    dlogK, dc = bs.coefs[:, 0, 3] - bs.coefs[:, 1, 3], bs.coefs[:, 0, 1] - bs.coefs[:, 1, 1]
    out["log10K_diff"] = claim(math.log10(ft.K / fr.K), dlogK)            # K_target > K_ref: > 0
    with np.errstate(divide="ignore", invalid="ignore"):                  # c_t = c_r: no crossover (inf / nan)
        out["log10_crossover"] = claim(math.log10(data_crossover(ft, fr)) if ft.c != fr.c else math.nan, dlogK / dc)
    for j, (lab, s) in enumerate(g.cols.items()):
        column = gains["cells"][j::len(g.cols)]                        # this column's cell at every budget
        inside = [i for i, c in enumerate(column) if not (c["extrapolated"] or c["gain"] is None)]
        if len(inside) >= 2:
            i1, i2 = inside[0], inside[-1]
            dec = math.log10(budgets[i2] / budgets[i1])
            pt = 100 * float(ce_gain(ft, fr, budgets[i2], s) - ce_gain(ft, fr, budgets[i1], s)) / dec
            out[f"growth/{lab}"] = claim(pt, 100 * (bs.gain[:, i2, j] - bs.gain[:, i1, j]) / dec,
                                         **{"from": budgets[i1], "to": budgets[i2]})
        ratio = float(tpp(ft, tpp_C, s) / tpp(fr, tpp_C, s))      # not |ratio - 1|: folded, biased
        out[f"tpp_ratio/{lab}"] = claim(ratio, bs.tpp[:, 0, j] / bs.tpp[:, 1, j])
    return out


def law_here(budgets: Sequence[float], cols: Mapping[str, float], tpp_C: float | None) -> dict:
    """What Table 4.3's surfaces predict at this run's budgets and sparsity columns (SMELT over Baseline): CE gain,
    its growth per decade and the TPP ratio. Extrapolated decades below the paper's window: read signs only."""
    t, r = PAPER_SMELT, PAPER_BASELINE
    out = {"gain": {lab: [float(ce_gain(t, r, C, s)) for C in budgets] for lab, s in cols.items()},
           "crossover_D": PAPER_CROSSOVER_D, "budgets": list(budgets)}
    if len(budgets) >= 2:
        dec = math.log10(budgets[-1] / budgets[0])
        out["growth_pp"] = {lab: 100 * (g[-1] - g[0]) / dec for lab, g in out["gain"].items()}
    if tpp_C is not None:
        out["tpp_ratio"] = {lab: float(tpp(t, tpp_C, s) / tpp(r, tpp_C, s)) for lab, s in cols.items()}
    return out


def _subset_report(g: _Grid, C: float, ref_rows: list[dict]) -> tuple[dict, dict]:
    """SMELT 5.2: identified intercept fits per domain / source, their CE gain at budget C per sparsity column,
    and the Baseline-loss quartiles at the middle column, sources ranked in every row of `ref_rows`."""
    (target, ref), report = g.names, {}
    for key in ("val_loss_by_domain", "val_loss_by_source"):
        sub = {a: subset_points(g.by_arch[a], key) for a in g.names}
        names = sorted(set(sub[target]) & set(sub[ref]))
        if not names:
            continue
        fitted, not_fitted = {}, {}
        for name in names:
            try:
                pair = []
                for a in g.names:
                    with warnings.catch_warnings(action="ignore"):
                        pair.append(_intercept_fit(sub[a][name], g.fits[a], rules=g.rules))
                    if pair[-1].why:
                        raise ValueError(f"{a}: " + "; ".join(pair[-1].why))
                fitted[name] = pair
            except ValueError as e:
                not_fitted[name] = str(e)
        gains = {n: {lab: gain_cell(ft.coeffs, fr.coeffs, C, s, ft.ranges, fr.ranges, g.names)
                     for lab, s in g.cols.items()} for n, (ft, fr) in fitted.items()}
        report[key] = {"budget": C, "gains": gains, "not_fitted": not_fitted}
    if "val_loss_by_source" not in report:
        return report, {"available": False, "why": ["no per-source losses in the rows"]}
    losses = [r["val_loss_by_source"] for r in ref_rows if r.get("val_loss_by_source")]
    return report, _quartiles(report["val_loss_by_source"]["gains"], list(g.cols)[len(g.cols) // 2], C, losses)


def _quartiles(gains: dict, lab: str, C: float, losses: list[dict]) -> dict:
    """report["quartiles"]: the per-source gains at column `lab` averaged per Baseline-loss quartile."""
    g = {n: v[lab]["gain"] for n, v in gains.items()}
    quart = {"available": False, "sparsity_label": lab, "budget": C}
    if any(v is None for v in g.values()):
        quart["why"] = ["a per-source gain lies below -9999 %"]
    elif len(g) < 4:
        quart["why"] = [f"{len(g)} per-source gains cannot fill 4 groups"]
    else:
        try:
            q = quartile_gains(g, losses)
        except ValueError as e:                      # a pair ranks fewer than 4 of these sources
            quart["why"] = [str(e)]
            return quart
        quart.update(available=True, why=[], gain=q.tolist(), pct=(100 * q).tolist(),
                     extrapolated=any(v[lab]["extrapolated"] for v in gains.values()))
    return quart


def analyse(rows: Sequence[dict], out: str, *, n_boot: int = 2000, n_jobs: int = 2, seed: int = 0,
            include_dense: bool = False, budgets: Sequence[float] | None = None,
            target: str = "smelt", ref: str = "baseline", rules: Rules = RULES) -> dict:
    """Fit every architecture in `rows` (train.py's results rows) and, only from identified fits, derive CE
    gains (target over ref), TPP, bootstrap intervals, per-subset gains and quartiles.  Writes coeffs.json,
    tables.json, tables.md and the plots to `out`; returns the report (its keys: docs/scaling.md)."""
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 0:
        raise ValueError(f"n_boot must be an integer >= 0 (0 skips the bootstrap), got {n_boot!r}")
    check_rows(rows)
    if target == ref:
        raise ValueError(f"target and ref must differ; both are {target!r}")
    os.makedirs(out, exist_ok=True)
    means = seed_means(rows)                     # a repeated cell counts once, at its seeds' mean loss
    g = _group(means, include_dense, target, ref)
    _fit_all(g, rules)
    report: dict = {"control_label": CONTROL_LABEL, "include_dense": include_dense, "n_rows": len(rows),
                    "seed_means": {f"{r['arch']} {cell_id(r)}": r["n_seeds"] for r in means if "n_seeds" in r},
                    "n_control_rows": g.n_control_rows, "unmatched_cells": g.unmatched,
                    "fits": {a: _fit_entry(g, a) for a in g.archs}, "sparsity": g.cols}
    report.update(_budgets(g, budgets))
    budgets, tpp_C, window = report["budgets"], report["tpp_budget"], report["compute_window"]
    Cgrid = np.geomspace(window[0], window[1], 40) if (g.both and window is not None) else np.empty(0)
    boots = _bootstraps(g, budgets, Cgrid, tpp_C, n_boot, seed, n_jobs)
    report["bootstrap"] = {k: {"surfaces": list(b.names), "n_draws": b.n_draws, "n_failed": b.n_failed,
                               "failed_share": b.failed_share, "failures": b.failures} for k, b in boots.items()}
    no_boot = {"interval": None, "interval_why": "no bootstrap (n_boot = 0)" if n_boot <= 0 else "no bootstrap",
               "n_draws": 0, "n_failed": 0, "failed_share": None}
    gains = report["gains"] = _gain_cells(g, budgets, boots, no_boot)
    report["tpp"] = {a: _tpp_cells(g, a, tpp_C, boots, no_boot) for a in g.archs}
    report["derived"] = _derived(g, gains, budgets, tpp_C, boots)
    report["law_here"] = law_here(budgets, g.cols, tpp_C)
    if gains["available"]:           # per-subset gains and quartiles (SMELT 5.2): only from two identified surfaces
        report["subsets"], report["quartiles"] = _subset_report(g, tpp_C, [r for r in means if r["arch"] == ref])
    else:
        report["subsets"] = {}
        report["quartiles"] = {"available": False, "why": gains["why"] or ["no CE gain"]}
    gain_plot = _gain_curve(g, Cgrid, boots, len(budgets)) if gains["available"] and len(Cgrid) else None
    report["figures"] = scaling_report.figures(out, g.pts, g.control, g.fits, g.why, g.cols, gain_plot, g.names)
    md = markdown(report)
    report["tables_md"] = "tables.md"
    for name, text in (("coeffs.json", json.dumps(report["fits"], indent=2)),
                       ("tables.json", json.dumps(report, indent=2, default=float)), ("tables.md", md)):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser("Fit SMELT Eq. 2 loss surfaces per architecture, say whether each fit is identified, and "
                    "from identified fits report CE gain, TPP, cell-bootstrap brackets, per-subset gains and plots.")
    ap.add_argument("--results", help="results.jsonl written by train.py (one JSON row per finished run)")
    checks.add_out_dir(ap, "output directory for JSON, tables and plots", default="scaling_out")
    ap.add_argument("--bootstrap", type=checks.nonneg_int, default=2000, help="cell-bootstrap draws (0 to skip)")
    ap.add_argument("--jobs", type=checks.positive_int, default=2, help="worker processes for the bootstrap")
    ap.add_argument("--seed", type=checks.nonneg_int, default=0, help="bootstrap seed")
    ap.add_argument("--budgets", type=checks.positive_float, nargs="+", help="compute budgets (FLOPs) for the CE-gain "
                    "table; default: the data's compute window (its geometric midpoint and log-quartiles); TPP uses "
                    "the middle one; budgets outside the data are marked extrapolated")
    ap.add_argument("--include-dense", action="store_true",
                    help=f"also fit the {CONTROL_LABEL.replace('%', '%%')} control cells (the paper excludes them)")
    ap.add_argument("--paper", action="store_true", help="print SMELT's CE-gain and TPP tables from Table 4.3")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.paper:
        print(paper_tables())
        return
    if not args.results:
        ap.error("give --results FILE or --paper")
    try:   # every row checked before any fit
        rows = read_results(args.results)
        check_rows(rows)
    except (OSError, ValueError) as e:
        ap.error(f"--results {args.results}: {getattr(e, 'strerror', None) or e}")
    analyse(rows, args.out_dir, n_boot=args.bootstrap, n_jobs=args.jobs, seed=args.seed,
            include_dense=args.include_dense, budgets=args.budgets)
    print(open(os.path.join(args.out_dir, "tables.md")).read())


if __name__ == "__main__":
    checks.run_main(main)
