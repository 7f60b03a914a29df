"""Calibration: how much better a model scores than a Baseline of the same validation loss (SMELT Eq. 6-7).

SMELT 5.1, Fig. 16: `calibrate` fits `sigmoid4` (Eq. 6, loss -> metric) on the Baseline endpoints and gives each
other model's residual (Eq. 7, positive = better than its loss predicts), only when the Baseline points identify
the fit (`calibration_problem`, then R^2 and no step across a gap); `calibration_report` does every metric of
CALIBRATION_METRICS and every task. Read before: tasks.py, eval.py. Read next: downstream_claims.py.
Notes: docs/calibration.md.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from lab import stats
from lab.tasks import centred_accuracy, chance_of


def sigmoid4(loss, a: float, b: float, alpha: float, tau: float, d: int):
    """SMELT Eq. 6: b + a / (1 + exp(-d alpha (loss - tau))), a, alpha > 0; d = +1 increasing, -1 decreasing."""
    z = np.clip(-d * alpha * (np.asarray(loss, dtype=float) - tau), -60, 60)
    return b + a / (1 + np.exp(z))


def fit_sigmoid(losses: Sequence[float], scores: Sequence[float], d: int) -> dict:
    """Least-squares fit of Eq. 6 (a, alpha > 0 via logs) from a grid of starts; returns params and R^2."""
    from scipy.optimize import least_squares
    x, y = np.asarray(losses, dtype=float), np.asarray(scores, dtype=float)
    if len(x) < 4:
        raise ValueError(f"the 4-parameter sigmoid needs >= 4 Baseline points, got {len(x)}")
    span_y, span_x = max(np.ptp(y), 1e-6), max(np.ptp(x), 1e-6)

    def resid(p):
        return sigmoid4(x, math.exp(p[1]), p[0], math.exp(p[2]), p[3], d) - y

    best = None
    for tau in np.quantile(x, [0.2, 0.5, 0.8]):
        for alpha in (2.0, 10.0):   # slope in units of the loss range
            fit = least_squares(resid, [y.min(), math.log(span_y), math.log(alpha / span_x), tau])
            if best is None or fit.cost < best.cost:
                best = fit
    b, la, lal, tau = best.x
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - 2 * best.cost / ss_tot if ss_tot > 0 else float("nan")
    return {"a": math.exp(la), "b": float(b), "alpha": math.exp(lal), "tau": float(tau), "d": d, "r2": r2}


CALIBRATION_MIN_POINTS = 5       # four parameters: at least one degree of freedom left
CALIBRATION_MIN_R2 = 0.5         # the curve must explain most of the Baseline's spread (paper: 0.91-0.997)
CALIBRATION_MAX_JUMP = 0.5       # share of the fitted curve's rise between two neighbouring Baseline losses


def calibration_problem(losses: Sequence[float], scores: Sequence[float], chance: float | None = None) -> str | None:
    """Why Eq. 6 cannot be identified from these Baseline points before fitting (None: try the fit): too few
    points, all losses equal, constant scores, or every score at or below `chance`."""
    x, y = np.asarray(losses, dtype=float), np.asarray(scores, dtype=float)
    if len(x) < CALIBRATION_MIN_POINTS:
        return (f"{len(x)} Baseline endpoint{'s' if len(x) != 1 else ''}; the 4-parameter sigmoid needs at least "
                f"{CALIBRATION_MIN_POINTS}")
    if np.ptp(x) <= 1e-9:
        return f"every Baseline endpoint has the same validation loss ({x[0]:.4f})"
    if np.ptp(y) <= 1e-9 * max(1.0, float(np.abs(y).max())):
        return f"every Baseline score is the same ({y[0]:.4g})"
    if chance is not None and (y <= chance + 1e-9).all():
        return f"every Baseline score is at or below chance ({chance:.4g}); max {y.max():.4g}"
    return None


def calibrate(base_losses: Sequence[float], base_scores: Sequence[float], other_losses: Sequence[float],
              other_scores: Sequence[float], higher_is_better: bool = True,
              other_groups: Sequence | None = None, chance: float | None = None,
              min_r2: float = CALIBRATION_MIN_R2) -> dict:
    """SMELT Eq. 6-7: fit loss -> metric on the Baseline (d = -s), the residual s (y - y_hat) of the others (s = +1
    for a score, -1 for a loss: positive is better than a Baseline of that loss). Not identified: {"identified":
    False, "why", "n_base"}; the mean residual and its interval are over the others `inside` the Baseline losses."""
    bl, bs = np.asarray(base_losses, dtype=float), np.asarray(base_scores, dtype=float)
    ol, os_ = np.asarray(other_losses, dtype=float), np.asarray(other_scores, dtype=float)
    for name, a, b in (("Baseline", bl, bs), ("other", ol, os_)):
        if a.shape != b.shape or a.ndim != 1:
            raise ValueError(f"calibrate: {name} losses and scores must be equal-length lists, "
                             f"got {a.shape} and {b.shape}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"calibrate: {name} losses / scores hold non-finite values")
    s = 1 if higher_is_better else -1
    out: dict = {"identified": False, "why": calibration_problem(bl, bs, chance), "n_base": len(bl)}
    if out["why"]:
        return out
    params = fit_sigmoid(bl, bs, d=-s)
    on_base = sigmoid4(np.sort(bl), params["a"], params["b"], params["alpha"], params["tau"], params["d"])
    jump = float(np.abs(np.diff(on_base)).max() / max(np.ptp(on_base), 1e-300))
    if not math.isfinite(params["r2"]) or params["r2"] < min_r2:
        out["why"] = f"the fit explains too little of the Baseline spread (R^2 < {min_r2:g})"  # no estimate printed
    elif jump > CALIBRATION_MAX_JUMP:
        out["why"] = (f"the fitted curve is a step: over {100 * CALIBRATION_MAX_JUMP:.0f} % of its rise lies between "
                      f"two neighbouring Baseline losses, so the data do not place its transition")
    if out["why"]:
        return out
    pred = sigmoid4(ol, params["a"], params["b"], params["alpha"], params["tau"], params["d"])
    res = s * (os_ - pred)
    inside = (ol >= bl.min()) & (ol <= bl.max())        # beyond the Baseline losses the sigmoid is extrapolated
    out.update(identified=True, params=params, residuals=res.tolist(), predicted=pred.tolist(),
               mean_residual=float(res[inside].mean()) if inside.any() else float("nan"),
               residual_interval=stats.mean_interval(res[inside]).to_dict() if inside.any() else None,
               inside=inside.tolist(), extrapolated=int((~inside).sum()))
    if other_groups is not None:
        groups = defaultdict(list)
        for g, r, keep in zip(other_groups, res, inside):
            if keep:
                groups[g].append(r)
        out["by_group"] = {g: float(np.mean(v)) for g, v in groups.items()}
    return out


# (metric name, summary origin, summary key, higher is better, chance in the metric's units)
CALIBRATION_METRICS = (("core", "real", "core", True, 0.0), ("completion", "real", "completion", False, None),
                       ("generated core", "generated", "core", True, 0.0),
                       ("generated completion", "generated", "completion", False, None))


def calibration_report(base: Sequence[dict], others: Sequence[dict], min_r2: float = CALIBRATION_MIN_R2) -> dict:
    """SMELT 5.1 on evaluate_endpoint records, base the Baseline endpoints, others the SMELT ones; per-task fits on
    centred accuracy at the headline k, their residuals averaged per task category and scale ("by_category")."""
    missing = [e.get("run", "?") for e in [*base, *others] if not e.get("val")]
    if missing:
        raise ValueError(f"calibration needs each endpoint's validation loss; none in {missing} "
                         f"(evaluate with validation)")
    scale = lambda e: str(e.get("scale") or e.get("run", "?"))
    fit = lambda get, **kw: calibrate([e["val"]["loss"] for e in base], [get(e) for e in base],
                                      [e["val"]["loss"] for e in others], [get(e) for e in others], min_r2=min_r2, **kw)
    report: dict = {"metrics": {}, "by_category": {}}
    for name, origin, key, higher, chance in CALIBRATION_METRICS:
        get = lambda e: e["summary"].get(origin, {}).get(key)
        vals = [get(e) for e in [*base, *others]]
        if all(v is None for v in vals):
            continue
        if any(v is None or not np.isfinite(v) for v in vals):
            report["metrics"][name] = {"identified": False, "why": f"{name} is missing for some endpoints",
                                       "n_base": len(base), "higher_is_better": higher}
            continue
        report["metrics"][name] = {**fit(get, higher_is_better=higher, other_groups=[scale(e) for e in others],
                                         chance=chance), "higher_is_better": higher}
    cat_res: dict = defaultdict(lambda: defaultdict(list))
    for name, t in (base[0]["tasks"].items() if base else []):
        k = str(t.get("headline_k"))
        get = lambda e: e["tasks"].get(name, {}).get("by_k", {}).get(k, {}).get("centred")
        if not all(get(e) is not None for e in [*base, *others]):
            continue
        chance = centred_accuracy(chance_of(t), t["rho"]) if "rho" in t else 0.0
        c = fit(get, chance=chance)
        report["metrics"][f"task/{name}"] = {**c, "higher_is_better": True}
        if c["identified"]:
            for e, r, keep in zip(others, c["residuals"], c["inside"]):
                if keep:
                    cat_res[t["category"]][scale(e)].append(r)
                    cat_res[t["category"]]["all"].append(r)
    report["by_category"] = {c: {s: float(np.mean(v)) for s, v in d.items()} for c, d in cat_res.items()}
    report["identified"] = [m for m, c in report["metrics"].items() if c["identified"]]
    report["not_identified"] = {m: c["why"] for m, c in report["metrics"].items() if not c["identified"]}
    return report
