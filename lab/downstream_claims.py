"""The grid's downstream claims: each an interval with a verdict (SMELT Sections 5.1, 5.3, Appendix C).

From wins.py's pieces (matched pairs, the shot sweep, length families) and calibration.py's residuals:
* `downstream_claims`: SMELT - Baseline gold-completion loss and centred accuracy per task origin, a
  paired difference over run pairs whose noise includes the item sample (`_item_noise`: items
  resampled, the same draw for every endpoint); the calibration residuals (Eq. 7) and their growth
  with scale; the length tilt; the shot-sweep claims (`icl_claims`) at the k that prompts fit.
* `downstream_report`: everything Section 5 reports from a grid's endpoint evaluations.
Interval verdicts come from `stats.verdict`; counts and refusals set theirs. Why each unit and rule: docs/wins.md.
Read before: wins.py, calibration.py, stats.py. Read next: report.py (how the claims are printed).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from lab import stats
from lab.calibration import calibration_report
from lab.tasks import centred_accuracy
from lab.wins import (WIN_METRICS, check_grid, icl_sweep, length_families, matched_pairs, metric_value, scale_rank,
                  win_counts)


# the paper's words for the shot-sweep claims (Sec. 5.3) and the calibration growth (Sec. 5.1)
PAPER_ICL_GAP = "\"0.9 pp at k=0 and widens to 1.9 pp once demonstrations are provided (k=1)\" (Sec. 5.3, Fig. 20b)"
PAPER_DYCK = "\"SMELT reaches 29.8% at k=32 vs. the Baseline’s 26.4%\" (Sec. 5.3, Fig. 20c)"
PAPER_SIGNIFICANT = ("\"the 14 of these 16 tasks where SMELT’s max-shot gain is significant (p<0.05, paired "
                     "permutation test)\" (Sec. 5.3, App. C)")
PAPER_RESIDUAL_POSITIVE = "\"The mean residual \\bar{\\delta} is positive on every benchmark at every scale\" (Sec. 5.1, Fig. 16)"
PAPER_RESIDUAL_GROWS = ("\"\\bar{\\delta} increases monotonically with model scale on DCLM Completion and DCLM Core\" "
                        "(Sec. 5.1, Fig. 16)")


def icl_claims(icl: dict, claim) -> None:
    """SMELT 5.3's shot-sweep claims over the real (BIG-bench) tasks, counting only a k at which most prompts
    keep k demonstrations (`_demos_kept`): the gap grows from k = 0 to the smallest such k > 0 (per task over
    the cells above chance at both k; t-interval over tasks), SMELT ahead on dyck_languages at its largest such
    k (t-interval over items, paired), and the share of tasks whose max-shot permutation test gives p < 0.05."""
    real = {n: t for n, t in icl.items() if t["origin"] == "bigbench"}
    grow, no_shared, sig, tested, p_min = [], [], 0, 0, []
    for n, t in real.items():
        ks = [int(k) for k, r in t["by_k"].items() if r["k_counts"] and r["gain"] is not None]
        if 0 in ks and any(k > 0 for k in ks):           # over the cells above chance at both k: the same cells
            rows = [t["by_k"][str(k)] for k in (0, min(k for k in ks if k > 0))]
            if any("gain_by_cell" not in r for r in rows):
                raise ValueError(f"icl_claims: task {n}'s shot sweep has no gain_by_cell (an icl_sweep result from "
                                 f"before 2026-12-03): run wins.icl_sweep on its records again")
            g0, g1 = (r["gain_by_cell"] for r in rows)
            if both := sorted(set(g0) & set(g1)):
                grow.append(float(np.mean([g1[c] - g0[c] for c in both])))
            else:
                no_shared.append(n)
        test = t["test"]
        if test["p"] is not None and t["by_k"][str(test["k"])]["k_counts"]:
            tested += 1
            sig += test["p"] < 0.05
            p_min.append(test["p_min"])
    iv = stats.mean_interval(grow) if grow else None
    claim("icl gap grows", "SMELT - Baseline accuracy gap at the smallest k > 0 minus at k = 0 > 0", PAPER_ICL_GAP,
          ">", 0.0, iv, len(grow), "task", "; ".join(filter(None, [
              None if grow else "no real task above chance in one cell at both k = 0 and a k > 0 that most prompts fit",
              f"left out, no cell above chance at both k: {', '.join(no_shared)}" if no_shared else None])) or None)
    d = real.get("dyck_languages")
    ks = [int(k) for k, r in (d or {}).get("by_k", {}).items() if r["k_counts"] and r["baseline_by_seed"]]
    unit = "paired item"   # each item's accuracy averaged over demonstration seeds and matched pairs
    if ks:   # a benchmark difference: its noise is the items' (the paper's 29.8 vs 26.4 % is over its test items)
        r = d["by_k"][str(max(ks))]
        b, s = r.get("baseline_by_item"), r.get("smelt_by_item")
        claim("dyck gain", f"SMELT - Baseline accuracy on dyck_languages at k = {max(ks)} > 0 (each item averaged "
              f"over demonstration seeds and matched pairs)", PAPER_DYCK, ">", 0.0,
              stats.paired_difference(b, s) if b else None, len(b or []), unit,
              None if b else "the endpoints scored different dyck_languages items: no paired interval")
    else:
        claim("dyck gain", "SMELT - Baseline accuracy on dyck_languages > 0", PAPER_DYCK, ">", 0.0, None, 0,
              unit, "dyck_languages not above chance (or cut) at any k in this run")
    floor = min(p_min, default=1.0)
    why = (f"{sig} of {tested} tasks significant" + (f"; with these seeds p cannot go below {floor:.3g}"
                                                      if floor >= 0.05 else "") if tested else
           "no real task tested at a k most of its prompts hold")
    # a count, not an interval: reproduced when most tested tasks are significant; too few seeds (or no
    # significant majority) leaves it not resolved, since a test that cannot reject is no evidence against
    claim("icl significant", "most tasks' max-shot gain significant (p < 0.05)", PAPER_SIGNIFICANT, ">", 0.5, None,
          tested, "task", why, verdict="reproduced" if tested and 2 * sig > tested else "not resolved")


def _item_draws(recs: list[dict], origin: str, key: str, n_boot: int, seed: int) -> tuple[np.ndarray, int] | str:
    """Each endpoint's summary `key` of `origin` (eval.summarise: "core" or "completion" at each task's headline k)
    recomputed on items resampled with replacement, the same draw of every task's items for every endpoint:
    (draws x endpoints, the fewest items of a task; row 0 the items as scored), or why there is none."""
    src, field = ("bigbench" if origin == "real" else "generated"), ("per_item" if key == "core" else "gold_nll_by_item")
    rng, parts, n_min = np.random.default_rng(seed), [], None
    names = sorted({n for r in recs for n, t in r.get("tasks", {}).items() if t["origin"] == src})
    for name in names:
        ts = [r.get("tasks", {}).get(name) for r in recs]
        by_k = [t["by_k"].get(str(t["headline_k"])) if t else None for t in ts]
        kind = next(t["kind"] for t in ts if t)
        if (key == "completion" and kind != "gen") or all(b is None for b in by_k):
            continue                                          # eval.summarise leaves these out too
        if any(b is None or b.get(field) is None or (key == "completion" and b.get("gold_tokens_by_item") is None)
               or b["items"] != by_k[0]["items"] for b in by_k):
            return f"{name}: the endpoints lack per-item results ({field}) on the same items"
        n = len(by_k[0]["items"])
        idx = np.vstack([np.arange(n), rng.integers(0, n, (n_boot, n))])
        n_min = min(n_min or n, n)
        if key == "core":
            parts.append(centred_accuracy(np.array([b["per_item"] for b in by_k])[:, idx].mean(-1).T, ts[0]["rho"]))
        else:
            parts.append((np.array([b["gold_nll_by_item"] for b in by_k])[:, idx].sum(-1).T,
                          np.array([b["gold_tokens_by_item"] for b in by_k])[:, idx].sum(-1).T))
    if not parts:
        return f"no {origin} task with per-item results"
    out = np.mean(parts, axis=0) if key == "core" else sum(p[0] for p in parts) / np.maximum(sum(p[1] for p in parts), 1)
    return out, n_min


def _item_noise(units: list[list[tuple]], origin: str, key: str, iv: stats.Interval, n_boot: int = 1000,
                seed: int = 0) -> dict:
    """The item sample's noise in a paired difference whose t-interval `iv` is over run pairs (every pair scores
    the same items, so `iv` holds training noise only). Items are resampled (models fixed; each unit's endpoint
    pairs averaged, then the units): "items", the percentile interval; "both", `iv` widened by the draws'
    variance (t quantile over the units, the two noises added), which decides the claim. {"why"} without
    per-item results; "inconsistent" when the items as scored do not give the records' summaries."""
    if n_boot < 2:
        return {"items": None, "both": None, "why": f"n_boot = {n_boot}: no item bootstrap"}
    flat = [p for u in units for p in u]
    recs = [b for b, _ in flat] + [s for _, s in flat]                   # every Baseline, then every SMELT
    got = _item_draws(recs, origin, key, n_boot, seed)
    if isinstance(got, str):
        return {"items": None, "both": None, "why": got}
    draws, n_items = got
    if not np.allclose(draws[0], [r["summary"][origin][key] for r in recs], rtol=1e-9, atol=1e-12):
        return {"items": None, "both": None, "inconsistent": True,
                "why": f"the per-item results do not add up to the endpoints' {origin} {key} (a record edited?)"}
    d = draws[1:, len(flat):] - draws[1:, :len(flat)]                     # SMELT - Baseline per endpoint pair
    ends = np.cumsum([0] + [len(u) for u in units])
    means = np.stack([d[:, a:b].mean(1) for a, b in zip(ends[:-1], ends[1:])], axis=1).mean(1)
    lo, hi = np.percentile(means, [50 * (1 - iv.level), 50 * (1 + iv.level)])
    items = stats.Interval(iv.mean, float(lo), float(hi), n_items, iv.level, "item bootstrap")
    both = None
    if iv.resolved:
        q = stats.t_quantile(0.5 + iv.level / 2, iv.n - 1)
        half = q * math.sqrt(((iv.hi - iv.lo) / (2 * q)) ** 2 + float(means.std(ddof=1)) ** 2)
        both = stats.Interval(iv.mean, iv.mean - half, iv.mean + half, iv.n, iv.level, "t, item noise added")
    return {"items": items, "both": both, "why": None}


def _noise_verdict(noise: dict, direction: str, why: str | None) -> tuple[str | None, str | None]:
    """(why, verdict) of a downstream difference from _item_noise: the interval of both noises decides; a task of
    too few items, or records whose items do not give their summary, decide nothing; without per-item results
    the t-verdict stands (verdict None) and why says what its interval holds."""
    join = lambda *w: "; ".join(filter(None, w))
    items = noise["items"]
    if items is not None and items.few_units:                 # the items' variance is not estimable
        return join(why, f"a task of {items.n} items: too few for the item bootstrap (docs/wins.md)"), "not resolved"
    if items is not None:
        return why, stats.verdict(noise["both"], direction, 0.0)
    if noise.get("inconsistent"):
        return join(why, noise["why"]), "not resolved"
    return join(why, f"no item bootstrap ({noise['why']}): the interval holds training noise only"), None


def downstream_claims(records: Sequence[dict], calibration: dict | None = None, families: dict | None = None,
                      unit: str = "run", icl: dict | None = None, n_boot: int = 1000) -> list[dict]:
    """The main job's downstream claims, each an interval decided by stats.verdict (SMELT 5.1, 5.3).

    For each origin (real BIG-bench tasks, generated tasks): SMELT - Baseline gold-completion loss
    (claim < 0) and centred accuracy (claim > 0), as stats.paired_difference over the matched pairs.
    unit="run" (default) first averages each run pair's endpoints (cell, seed), so the units are
    independent trainings; unit="endpoint" pairs every matched endpoint (cell, seed, branch), whose
    interval counts the endpoints of one run (one trajectory) as if they were independent. Every pair scores
    the same items, so that interval holds training noise only; where the records carry per-item results
    (tasks.evaluate_task), _item_noise adds "items_interval" (n_boot item resamples) and "both_interval"
    (the two noises added), which gives the verdict; without them "why" says so.
    calibration (calibration_report): the mean Eq. 7 residual of every identified metric, with its
    t-interval over SMELT runs (each run's endpoints averaged: they share a trajectory; claim > 0); a
    metric whose fit is not identified is listed with verdict "not resolved" and why. families
    (length_families): SMELT's long/short ratio > 1 (not resolved below stats.MIN_BOOTSTRAP_UNITS contrasts).
    Returns [{"id", "claim", "paper", "direction", "value", "interval" (Interval dict | None),
    "verdict", "n", "unit", "why"}], the differences also "items_interval" and "both_interval" (dict | None).
    """
    if unit not in ("endpoint", "run"):
        raise ValueError(f"unit must be 'endpoint' or 'run', got {unit!r}")
    pairs = matched_pairs(records)
    claims = []

    def claim(cid, text, paper, direction, value, iv, n, unit_, why=None, verdict=None):
        claims.append({"id": cid, "claim": text, "paper": paper, "direction": direction, "value": value,
                       "interval": iv.to_dict() if iv is not None else None,
                       "verdict": verdict or stats.verdict(iv, direction, value), "n": n, "unit": unit_, "why": why})

    for origin, src in (("real", "BIG-bench tasks"), ("generated", "generated tasks")):
        for key, direction, what, paper in (("completion", "<", "gold-completion loss", WIN_METRICS[1][3]),
                                            ("core", ">", "centred accuracy", WIN_METRICS[2][3])):
            paper = paper if origin == "real" else None          # the paper has no generated tasks
            metric = f"{origin} {key}"
            units = defaultdict(list)
            for p in pairs:
                if metric_value(p["baseline"], metric) is not None and metric_value(p["smelt"], metric) is not None:
                    units[(p["cell"], p["seed"]) if unit == "run" else len(units)].append((p["baseline"], p["smelt"]))
            if not units:
                continue
            b = [float(np.mean([metric_value(x, metric) for x, _ in u])) for u in units.values()]
            s = [float(np.mean([metric_value(y, metric) for _, y in u])) for u in units.values()]
            iv = stats.paired_difference(b, s)
            why, verdict = (None if iv.resolved else f"{len(b)} pair(s) without spread: no interval"), None
            noise = _item_noise(list(units.values()), origin, key, iv, n_boot)
            why, verdict = _noise_verdict(noise, direction, why)
            if key == "core" and max(b + s) <= 0:   # centred accuracies below chance rank nothing
                why, verdict = "both models at or below chance (centred accuracy <= 0) in every pair", "not resolved"
            claim(f"{metric} difference", f"SMELT - Baseline {what}, {src} {direction} 0", paper, direction, 0.0, iv,
                  len(b), "matched endpoint pair" if unit == "endpoint" else "matched run pair", why, verdict)
            claims[-1].update({f"{k}_interval": noise[k].to_dict() if noise[k] is not None else None
                               for k in ("items", "both")})
    if calibration is not None and calibration.get("error"):
        claim("calibration residual", "calibration residual (Eq. 7) of SMELT > 0",
              PAPER_RESIDUAL_POSITIVE, ">", 0.0, None, 0, "SMELT endpoint",
              f"calibration not available: {calibration['error']}")
    if calibration is not None:
        for name, c in calibration.get("metrics", {}).items():
            if name.startswith("task/"):
                continue
            text = f"calibration residual (Eq. 7) of SMELT on {name} > 0"
            paper = PAPER_RESIDUAL_POSITIVE
            if not c.get("identified"):
                claim(f"{name} residual", text, paper, ">", 0.0, None, 0, "SMELT endpoint",
                      f"calibration not identified: {c.get('why')}")
                continue
            runs = _run_means(records, c["residuals"], c.get("inside"))
            iv = stats.mean_interval([v for _, v in runs.values()]) if runs else None
            claim(f"{name} residual", text, paper, ">", 0.0, iv, len(runs), "SMELT run",
                  _residual_why(c, iv, "too few SMELT runs for an interval"))
    if calibration is not None:
        _residual_growth(records, calibration, claim)
    if icl is not None:
        icl_claims(icl, claim)
    if families is not None and "SMELT vs Baseline" in families:
        f = families["SMELT vs Baseline"]
        iv = stats.Interval(**f["long_short"]) if f.get("long_short") else None
        why = f.get("why")
        if iv is not None and f.get("n_negative", 0) * 2 > f["n_contrasts"]:
            # SMELT worse on average: the ratio then describes a deficit, not a gain (docs/wins.md): no verdict
            why, iv = (f"SMELT's mean gain is negative in {f['n_negative']} of {f['n_contrasts']} contrasts: the "
                       f"normalised shape describes a loss, not a gain (ratio {stats.Interval(**f['long_short']).fmt(2)})"), None
        if iv is not None and iv.resolved and iv.few_units:   # not resolved (stats.verdict); the interval is kept
            why = (f"{iv.n} contrasts: a percentile bootstrap over fewer than {stats.MIN_BOOTSTRAP_UNITS} units "
                   f"covers the truth less often than it says (docs/wins.md)")
        claim("length tilt", "SMELT's gain tilts to long documents: long/short ratio > 1",
              "1.52: \"SMELT’s gain on the four longest buckets is 1.52× its gain on the four shortest; the two controls "
              "stay flat (0.98 and 0.88)\" (Sec. 5.3, Fig. 20a)", ">", 1.0, iv, f["n_contrasts"],
              "SMELT/Baseline run pair", why)
    return claims


def _run_means(records: Sequence[dict], residuals: Sequence[float], inside: Sequence[bool] | None = None) -> dict:
    """{(scale, sparsity label, seed): (scale, mean residual)}: the SMELT endpoints' Eq. 7 residuals (in the order of
    the SMELT endpoints in `records`, as downstream_report hands them to calibration_report) averaged per run, the
    independent unit: the branches of one run share its stable phase.  `inside` (calibrate's): only endpoints
    within the Baseline loss range count; beyond it the residual measures the sigmoid's extrapolation."""
    smelt = [r for r in records if r["arch"] == "smelt"]
    by = defaultdict(list)
    for r, v, keep in zip(smelt, residuals, inside if inside is not None else [True] * len(residuals)):
        if keep:
            by[(r.get("scale") or r.get("run", "?"), r.get("sparsity_label"), r.get("seed", 0))].append(v)
    return {k: (str(k[0]), float(np.mean(v))) for k, v in by.items()}


def _residual_why(c: dict, iv: stats.Interval | None, too_few: str) -> str | None:
    """A residual claim's why: `too_few` when it has no interval, then how many SMELT endpoints of calibration `c`
    lie outside the Baseline loss range and were left out (None when neither applies)."""
    n = len(c.get("inside") or []) - sum(c.get("inside") or [])
    outside = (f"{n} of {len(c['inside'])} SMELT endpoints lie outside the Baseline loss range and are left out "
               f"(their residual would measure the sigmoid's extrapolation)") if n else None
    return "; ".join(filter(None, [too_few if iv is None or not iv.resolved else None, outside])) or None


def _residual_growth(records: Sequence[dict], calibration: dict, claim) -> None:
    """SMELT 5.1: the mean Eq. 7 residual grows with scale, per identified real metric: the largest scale's
    SMELT runs' mean residuals minus the smallest's (Welch interval over runs; claim > 0)."""
    groups = [str(r.get("scale") or r.get("run", "?")) for r in records if r["arch"] == "smelt"]
    rank = scale_rank(records)
    for name in ("completion", "core"):
        c = calibration.get("metrics", {}).get(name)
        if c is None:
            continue
        text = f"calibration residual of SMELT on {name}: largest scale minus smallest > 0"
        scales = sorted(set(groups), key=lambda g: rank.get(g, 0))
        if not c.get("identified") or len(scales) < 2:
            claim(f"{name} residual growth", text, PAPER_RESIDUAL_GROWS, ">", 0.0, None, 0, "SMELT endpoint",
                  f"calibration not identified: {c.get('why')}" if not c.get("identified") else "one scale")
            continue
        by = defaultdict(list)
        for g, v in _run_means(records, c["residuals"], c.get("inside")).values():
            by[g].append(v)
        n = len(by[scales[0]]) + len(by[scales[-1]])
        iv = stats.welch_difference(by[scales[0]], by[scales[-1]]) if by[scales[0]] and by[scales[-1]] else None
        claim(f"{name} residual growth", f"{text} ({scales[-1]} vs {scales[0]})", PAPER_RESIDUAL_GROWS, ">", 0.0,
              iv, n, "SMELT run", _residual_why(c, iv, "too few SMELT runs per scale for an interval"))


def downstream_report(records: Sequence[dict], margin: float = 0.0, n_boot: int = 2000, n_perm: int = 10000,
                      unit: str = "run") -> dict:
    """Everything SMELT Section 5 reports from a grid's endpoint evaluations (evaluate_endpoint outputs).

    Returns {"n_endpoints", "n_pairs", "wins" (win_counts), "icl" (icl_sweep), "families"
    (length_families), "calibration" (calibration_report on every Baseline endpoint against every
    SMELT endpoint; {"error"} when the endpoints lack validation), "claims" (downstream_claims)}.
    """
    recs = list(records)
    check_grid(recs)
    base = [r for r in recs if r["arch"] == "baseline"]
    smelt = [r for r in recs if r["arch"] == "smelt"]
    try:
        cal = calibration_report(base, smelt)
    except ValueError as e:
        cal = {"error": str(e), "metrics": {}}
    fams = length_families(recs, n_boot)
    icl = icl_sweep(recs, margin, n_perm)
    return {"n_endpoints": len(recs), "n_pairs": len(matched_pairs(recs)), "wins": win_counts(recs),
            "icl": icl, "families": fams, "calibration": cal,
            "claims": downstream_claims(recs, cal, fams, unit, icl, n_boot)}
