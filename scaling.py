"""Scaling laws: separate loss surfaces, compute-optimal frontier, CE gain, TPP (SMELT Section 4).

What this file implements
-------------------------
* The loss surface of SMELT Eq. 2,  L(F, S, D) = E + A (1 - S)^b / F^a + K / D^c,
  with F = per-token training FLOPs, S = compute-equivalent sparsity (a fraction), D = tokens.
* `fit` / `fit_result`: Chinchilla Approach 3 as Hoffmann et al. and Epoch AI run it: Huber loss
  (delta 1e-3) on log-loss residuals, minimised with L-BFGS-B from a grid of starts (Section 4.3).
* `identify`: whether a fit means anything (the rules below); `analyse` prints no derived number
  (CE gain, TPP, per-source gain, quartile) from a fit that is not identified.
* The compute-optimal frontier for a budget C = F * D: F* (Eq. 3), L*(C, S) (Eq. 4, gamma =
  ac/(a+c)), the CE gain of a target over a reference (Eq. 5, by inverting the reference
  frontier) and tokens per dense-equivalent parameter TPP = D* / (F*/6).
* The cell bootstrap behind the paper's brackets (resample grid cells, refit both surfaces, a draw
  whose refit is not identified counts as failed), per-subset intercept fits with shared exponents
  (Section 5.2), the quartile grouping by Baseline loss, plots, and a CLI over train.py's rows.

Which rows are fitted
---------------------
The S = 0 control is a property of the *cell*: rows whose sparsity_label is CONTROL_LABEL ("S=0%",
the label budget.py's presets use) are the control for both architectures, whatever S they measure
(SMELT's measure S = +0.04..0.08), and are left out of the fits (SMELT 4.3) unless include_dense.
CE gains compare cells that both architectures have (unmatched cells are listed and left out).

When a fit is identified (`Rules`; each failed check becomes one "key: detail" reason)
------------------------------------------------------------------------------------------
  data     points >= 2 per free coefficient (12 for six): at fewer the surface nearly interpolates
           and its RMSE says nothing.  Compute C = F D spans >= 10x (one decade; the paper's window
           is 170x, Chinchilla's ~9,000x); F and D each span >= 2x separately: an exponent is read
           off the spread of its own variable, and at one value it is not estimable at all.  With
           b free, 1 - S spans >= 1.5x (a single sparsity level pins b = 0 instead: it is absorbed
           in A and the frontier at that S is unchanged).
  bounds   a and c in [0.05, 2] (the optimiser's bounds are [0, 4]).  As a -> 0, A F^-a -> A - aA
           log F: E, A and a collapse into two numbers, so an exponent near 0 means the term was
           not measured; above 2 a term falls by > 100x per decade, 3x steeper than any published
           fit (SMELT's c = 0.70 is the largest) and it vanishes inside the data.
  signs    a > 0, c > 0 (more FLOPs / more tokens never raise the loss; a fit with either at 0
           has no compute-optimal frontier).  b >= 0 as in SMELT Table 4.3 (b = 0.153 / 0.146):
           "higher sparsity (lower 1 - S) shrinks [the capacity term], because a sparser model
           stores more total parameters for the same per-token cost" (Section 4.2).  A negative b
           says extra experts at equal F hurt, which contradicts the premise of the term; b <= 2.
  ratio    c / a in [0.25, 4], i.e. the compute-optimal F* grows as C^(c/(a+c)) with a power
           between 0.2 and 0.8.  Published fits put it at 0.45-0.73 (Chinchilla 0.45, Epoch's
           replication 0.51, SMELT 0.64, Kaplan 0.73); outside [0.2, 0.8] one of the two exponents
           has collapsed against the other and the optimum sends ~all compute to model size or
           to tokens.
  noise    each of a and c at least 2 standard errors from 0 (Gauss-Newton covariance of the
           log-loss residuals at the optimum, s^2 = RSS / (n - p)); a singular or ill-conditioned
           Jacobian (condition number > 1e12 after column scaling) gives an infinite error.  This
           is the check that sees the noise: the spread floors above cannot.
           Two standard errors is a 95 % criterion, not a guarantee: a nearly flat data term
           (truth c = 0.02) was once fitted as c = 0.27 +- 0.12 and passed; the bootstrap interval
           is what shows such uncertainty downstream.
  optimiser  L-BFGS-B did not stop at its iteration limit away from a stationary point.

Measured (`calibrate_rules`, 300 pairs of fits: F spans {1.5, 2, 3, 5, 16}x x D spans {1.5, 2, 4,
10}x x log-noise {0.003, 0.01, 0.03} x 5 seeds on 4 x 3 x 6 paper-shaped grids drawn from Table
4.3's two surfaces; CE gain at S = 0.95 at the data's midpoint, true gain 7-15 %; 14 min on the
shared 2-core machine): the 50 pairs these rules call identified miss the true gain by a median
2.2 pp (90th percentile 8.2, worst 18.4); the 250 they reject miss it by a median 36 pp (90th
percentile 659 pp) and 23 of them have no frontier at all.  The span floors matter on their own:
15 low-noise fits pass every other rule yet miss by a median 5.9 pp, up to 50 pp (F spanning 1.5x
or C spanning 8x).  The paper's own grid spans C 170x.

What analyse reports, and where
-------------------------------
* CE-gain budgets default to the data's own compute window (the overlap of both architectures'
  C ranges): its geometric midpoint and the log-quartiles either side.  Not the ends: Eq. 5
  inverts the reference's frontier at C_ref = C / (1 - gain), so at an end of the window any
  nonzero gain puts C_ref outside the data.  TPP is reported at the midpoint.
* A gain or TPP is "extrapolated" (with reasons) if its budget C lies outside the fitted
  surface's compute range, if C_ref lies outside the reference's, or if the frontier point
  (F*, D* = C/F*) of either surface lies outside that surface's F or D range (the surface is
  then evaluated where no model was trained).  The last is stricter than the paper, which only
  states a compute window.
* Intervals are the 2.5 / 97.5 percentiles of the cell-bootstrap draws that refit to identified
  surfaces, reported with the share of draws that failed.  No interval is given when fewer than
  10 draws succeed, when more than half fail (the survivors are then a biased subsample), or when
  a bound lies beyond -9999 % (the reference would need > 100x the compute: no information).
* Gains are fractions in the dict and percent in the tables; a gain below -99.99 (-9999 %) is
  given as None with its text ("< -9999 %").  No number in tables.md has more than 8 digits.

Design choices and why
----------------------
* The fit runs in the log-sum-exp form  log L_hat = LSE(e, alpha - a log F + b log(1-S), kappa - c log D)
  with E = exp(e), A = exp(alpha), K = exp(kappa): positivity is free and the Huber residual is
  linear-ish in every parameter.  log F, log(1-S) and log D are *centred* on their means before
  fitting (alpha and kappa absorb the shift): uncentred, alpha moves with a * log F ~ 20 a and the
  problem is badly conditioned.  Gradients are analytic (the softmax weights of the LSE).
* The optimiser sees the Huber sum divided by delta^2, so the quadratic region is (r/delta)^2 / 2
  and L-BFGS-B's absolute gradient tolerance means something; `huber_objective` reports the
  unscaled sum (Epoch's convention).  Same minimiser either way.
* Starts: a grid over (a, b, c, E share, term share) in centred coordinates, all scored in one
  cheap pass; L-BFGS-B then runs from the best `n_starts` (default 24) plus any `init` coefficients
  you pass (the bootstrap passes the full-data fit).  This keeps a 72-point fit at about a second.
* `fixed` pins exponents (and E): with S constant (Chinchilla, dense runs) b is unidentifiable and
  is pinned to 0 with a warning; per-subset fits pin (a, b, c) to the aggregate fit's.
* The frontier quantities are closed forms (Eqs. 3-5), not numerical searches, so they are exact,
  vectorised and cheap inside 2,000 bootstrap draws.
* The paper prints its coefficients rounded (exponents to 4 decimals).  The CE gain is sensitive to
  that rounding (up to ~1 pp per entry), so from the printed coefficients we reproduce the TPP table
  exactly and the CE-gain table to within 0.15 pp (each entry ~0.1 pp low); tests/test_scaling.py
  shows that coefficients inside the printed rounding reproduce both tables to the printed digit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import textwrap
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import minimize

import cli
import stats

try:  # scipy's L-BFGS-B calls BLAS on 6-vectors; multi-threaded BLAS on a busy machine makes that ~30x slower
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: correct without it, only slower on loaded machines
    threadpool_limits = None


@dataclass
class Coeffs:
    """Six coefficients of SMELT Eq. 2 (loss in nats, F in FLOPs/token, D in tokens)."""
    E: float; A: float; K: float; a: float; b: float; c: float


# SMELT Table 4.3 (separate surfaces on S ~ {85, 95, 97} %), as printed.
PAPER_BASELINE = Coeffs(E=1.4439, A=1.366e3, K=1.975e6, a=0.3703, b=0.1530, c=0.6594)
PAPER_SMELT = Coeffs(E=1.4493, A=1.963e3, K=5.264e6, a=0.3892, b=0.1460, c=0.7011)
PAPER_SPARSITIES = (0.85, 0.95, 0.97)
PAPER_BUDGETS = (1e20, 1e21, 1e22)
# The paper's printed tables, for side-by-side comparison only (never used to compute anything).
PAPER_CE_GAIN_PCT = {1e20: (10.0, 7.8, 6.8), 1e21: (18.0, 15.8, 14.7), 1e22: (23.5, 20.9, 19.6)}
PAPER_TPP_1E21 = {"baseline": (56, 78, 91), "smelt": (56, 75, 86)}

CONTROL_LABEL = "S=0%"  # the S = 0 control cells' sparsity_label (configs.PAPER_POOLS; tests pin the two equal)
EXPONENTS = ("a", "b", "c")
BOUNDS = {"a": (0.0, 4.0), "b": (-2.0, 4.0), "c": (0.0, 4.0)}   # exponents; e/alpha/kappa are free
S_ROUNDING = 1e-9       # S in [-1e-9, 0) is rounding of an exact 0 (clipped); below that S is refused
GAIN_FLOOR = -99.99     # gains below this (-9999 %: C_ref < C / 100) are reported as None


@dataclass(frozen=True)
class Rules:
    """Identification thresholds; the module docstring gives the reason for each."""
    min_points_per_coef: float = 2.0
    min_C_ratio: float = 10.0
    min_F_ratio: float = 2.0
    min_D_ratio: float = 2.0
    min_one_minus_S_ratio: float = 1.5      # only when b is free
    exp_min: float = 0.05                   # a, c
    exp_max: float = 2.0
    b_min: float = 0.0
    b_max: float = 2.0
    c_over_a: tuple = (0.25, 4.0)
    min_t: float = 2.0                      # exponent / its standard error, for a and c
    max_cond: float = 1e12
    # bootstrap intervals
    min_ok_draws: int = 10
    max_failed_share: float = 0.5


RULES = Rules()


# ----------------------------------------------------------------------------- Eq. 2
def loss(co: Coeffs, F, S, D) -> np.ndarray:
    """SMELT Eq. 2, vectorised over broadcastable F (FLOPs/token), S (fraction < 1), D (tokens)."""
    F, S, D = (np.asarray(x, dtype=float) for x in (F, S, D))
    return co.E + co.A * (1.0 - S) ** co.b / F ** co.a + co.K / D ** co.c


def _vector(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a sequence of numbers ({e})") from None
    return a.ravel()


def _check_points(F, S, D, L) -> tuple[np.ndarray, ...]:
    """Validate fit inputs: non-empty, equal-length, finite, F, D, L > 0, 0 <= S < 1.  Float arrays."""
    arrs = [_vector(x, n) for x, n in zip((F, S, D, L), "FSDL")]
    for name, x in zip("FSDL", arrs):
        if x.size == 0:
            raise ValueError(f"{name} is empty: a fit needs points")
    n = len(arrs[0])
    for name, x in zip("FSDL", arrs):
        if len(x) != n:
            raise ValueError(f"F, S, D, L must have equal lengths; {name} has {len(x)}, F has {n}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} contains NaN or inf at index {int(np.flatnonzero(~np.isfinite(x))[0])}")
    for name, x in zip("FDL", (arrs[0], arrs[2], arrs[3])):
        if np.any(x <= 0):
            raise ValueError(f"{name} must be positive; got {x.min()} at index {int(np.argmin(x))}")
    S = arrs[1]
    if np.any(S < -S_ROUNDING):
        raise ValueError(f"S must be >= 0 (compute-equivalent sparsity, a fraction); got {S.min()} "
                         f"at index {int(np.argmin(S))}")
    if np.any(S >= 1):
        raise ValueError(f"S must be < 1 (a fraction, not a percentage); got max {S.max()}")
    arrs[1] = np.maximum(S, 0.0)
    return tuple(arrs)


# ----------------------------------------------------------------------------- the fit
@dataclass
class FitResult:
    coeffs: Coeffs
    rmse: float            # nats, on L itself (not log L), as the paper's Table 4.3 reports
    objective: float       # sum of Huber(delta) over log-loss residuals (Epoch's convention)
    converged: bool
    n_points: int
    fixed: dict = field(default_factory=dict)
    se: dict = field(default_factory=dict)       # standard errors of the free exponents (inf: unresolved)
    ranges: dict = field(default_factory=dict)   # data spans {"F", "D", "C", "one_minus_S"}: (lo, hi)
    why: list = field(default_factory=list)      # reasons the fit is not identified; [] = identified

    @property
    def identified(self) -> bool:
        return not self.why


def _ranges(F, S, D) -> dict:
    C = F * D
    return {k: (float(v.min()), float(v.max())) for k, v in (("F", F), ("D", D), ("C", C), ("one_minus_S", 1 - S))}


def _g(x: float) -> str:
    """A number for a reason string: 3 significant digits, never long."""
    return "inf" if math.isinf(x) else f"{x:.3g}"


def identify(res: FitResult, rules: Rules = RULES) -> list[str]:
    """Reasons (one "key: detail" string per failed check, see the module docstring) why `res` is
    not identified; an empty list means identified.  Uses only res's data ranges, coefficients,
    standard errors, pinned coefficients and convergence flag."""
    why = []
    co, rg, fixed = res.coeffs, res.ranges, res.fixed
    n_free = 6 - len(fixed)
    if res.n_points < rules.min_points_per_coef * n_free:
        why.append(f"too few points: {res.n_points} for {n_free} coefficients "
                   f"(< {rules.min_points_per_coef:g} per coefficient)")
    if not {"C", "F", "D", "one_minus_S"} <= set(rg):
        return why + ["data ranges: unknown (a FitResult from fit_result carries them)"]
    span = {k: hi / lo for k, (lo, hi) in rg.items()}
    for k, name, lim in (("C", "compute", rules.min_C_ratio), ("F", "F", rules.min_F_ratio),
                         ("D", "D", rules.min_D_ratio)):
        if span[k] < lim:
            why.append(f"{name} range: {name} spans only {_g(span[k])}x (< {lim:g}x)")
    if "b" not in fixed and span["one_minus_S"] < rules.min_one_minus_S_ratio:
        why.append(f"sparsity range: b is free but 1 - S spans only {_g(span['one_minus_S'])}x "
                   f"(< {rules.min_one_minus_S_ratio:g}x)")
    if not res.converged:
        why.append("not converged: L-BFGS-B stopped away from a stationary point")
    for k in ("a", "c"):
        v = getattr(co, k)
        if k in fixed:
            continue
        if v <= 0:
            why.append(f"exponent sign: {k} = {_g(v)} is not > 0")
        elif v < rules.exp_min:
            why.append(f"exponent bound: {k} = {_g(v)} within {rules.exp_min:g} of its bound 0")
        elif v > rules.exp_max:
            why.append(f"exponent bound: {k} = {_g(v)} > {rules.exp_max:g}")
    if "b" not in fixed:
        if co.b < rules.b_min:
            why.append(f"exponent sign: b = {_g(co.b)} < 0 (sparser cells fit worse at equal F, "
                       f"against SMELT's b > 0)")
        elif co.b > rules.b_max:
            why.append(f"exponent bound: b = {_g(co.b)} > {rules.b_max:g}")
    if co.a > 0 and co.c > 0:
        r = co.c / co.a
        lo, hi = rules.c_over_a
        if not lo <= r <= hi:
            why.append(f"exponent ratio: c / a = {_g(r)} outside [{lo:g}, {hi:g}] "
                       f"(F* would grow as C^{_g(co.c / (co.a + co.c))})")
    for k in ("a", "c"):
        v, se = getattr(co, k), res.se.get(k, 0.0)
        if k not in fixed and v > 0 and not v >= rules.min_t * se:
            why.append(f"exponent uncertain: {k} = {_g(v)} +- {_g(se)} (< {rules.min_t:g} standard errors from 0)")
    return why


class _Design:
    """Centred log-features of the data: x = log F - mu_F, s = log(1-S) - mu_S, y = log D - mu_D."""

    def __init__(self, F, S, D, L):
        lF, lS, lD = np.log(F), np.log1p(-S), np.log(D)
        self.mu = np.array([lF.mean(), lS.mean(), lD.mean()])
        self.x, self.s, self.y = lF - self.mu[0], lS - self.mu[1], lD - self.mu[2]
        self.logL = np.log(L)

    def to_theta(self, co: Coeffs) -> np.ndarray:
        """Coeffs -> centred parameter vector (e, alpha_c, kappa_c, a, b, c)."""
        alpha_c = math.log(co.A) - co.a * self.mu[0] + co.b * self.mu[1]
        return np.array([math.log(co.E), alpha_c, math.log(co.K) - co.c * self.mu[2], co.a, co.b, co.c])

    def to_coeffs(self, th: np.ndarray) -> Coeffs:
        e, al, ka, a, b, c = (float(v) for v in th)
        return Coeffs(E=math.exp(e), A=math.exp(al + a * self.mu[0] - b * self.mu[1]),
                      K=math.exp(ka + c * self.mu[2]), a=a, b=b, c=c)

    def log_model(self, th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log L_hat (N,) and its Jacobian (N, 6) with respect to th."""
        e, al, ka, a, b, c = th
        z = np.stack([np.full_like(self.x, e), al - a * self.x + b * self.s, ka - c * self.y], axis=1)  # (N, 3)
        m = z.max(axis=1, keepdims=True)                     # plain numpy LSE: scipy's is ~50x slower here
        ez = np.exp(z - m)
        w = ez / ez.sum(axis=1, keepdims=True)               # (N, 3) softmax weights = d LSE / d z
        jac = np.stack([w[:, 0], w[:, 1], w[:, 2], -w[:, 1] * self.x, w[:, 1] * self.s, -w[:, 2] * self.y], axis=1)
        return m[:, 0] + np.log(ez.sum(axis=1)), jac


def _gauss_newton_se(J_NP: np.ndarray, r_N: np.ndarray, max_cond: float) -> np.ndarray:
    """Standard errors (P,) from the Gauss-Newton covariance s^2 (J^T J)^-1, s^2 = RSS / (N - P);
    inf for all when N <= P or J^T J (columns scaled to unit norm) has condition number > max_cond."""
    n, p = J_NP.shape
    norms = np.linalg.norm(J_NP, axis=0)
    if n <= p or np.any(norms == 0):
        return np.full(p, np.inf)
    Js = J_NP / norms
    M = Js.T @ Js
    if not np.isfinite(M).all() or np.linalg.cond(M) > max_cond:
        return np.full(p, np.inf)
    s2 = float(r_N @ r_N) / (n - p)
    return np.sqrt(np.maximum(np.diag(np.linalg.inv(M)), 0.0) * s2) / norms


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    return np.where(np.abs(r) <= delta, 0.5 * r ** 2, delta * (np.abs(r) - 0.5 * delta))


def huber_objective(co: Coeffs, F, S, D, L, delta: float = 1e-3) -> float:
    """The fit objective: sum_i Huber_delta(log L_hat_i - log L_i)."""
    F, S, D, L = _check_points(F, S, D, L)
    return float(_huber(np.log(loss(co, F, S, D)) - np.log(L), delta).sum())


def _starts(des: _Design, L: np.ndarray, free_b: bool) -> list[np.ndarray]:
    """Grid of centred starting points: exponents x E share of min L x capacity share of the rest."""
    Lmid = float(np.exp(np.median(des.logL)))
    out = []
    for a, b, c, fe, q in product((0.15, 0.4, 0.8), (0.0, 0.5) if free_b else (0.0,), (0.15, 0.4, 0.8),
                                  (0.3, 0.6, 0.9), (0.25, 0.5, 0.75)):
        E = fe * float(L.min())
        out.append(np.array([math.log(E), math.log(q * (Lmid - E)), math.log((1 - q) * (Lmid - E)), a, b, c]))
    return out


def fit_result(F, S, D, L, *, fixed: Mapping[str, float] | None = None, delta: float = 1e-3,
               init: Sequence[Coeffs] = (), n_starts: int | None = 24, maxiter: int = 2000,
               rules: Rules = RULES) -> FitResult:
    """Fit Eq. 2 (see `fit`) and report RMSE, objective, convergence, the exponents' standard errors,
    the data's ranges and `why` (reasons it is not identified, `identify`) with the coefficients."""
    F, S, D, L = _check_points(F, S, D, L)
    fixed = dict(fixed or {})
    if not set(fixed) <= {"E", *EXPONENTS}:
        raise ValueError(f"`fixed` may pin E, a, b, c only; got {sorted(fixed)}")
    if "b" not in fixed and np.ptp(np.log1p(-S)) == 0:
        warnings.warn("all points share one sparsity S: b is unidentifiable, fixing b = 0", stacklevel=2)
        fixed["b"] = 0.0
    n_free = 6 - len(fixed)
    if len(L) < n_free:
        raise ValueError(f"{len(L)} points cannot determine {n_free} free coefficients")
    for name, x in (("F", F), ("D", D)):
        if np.ptp(x) == 0 and not {"a" if name == "F" else "c"} <= set(fixed):
            raise ValueError(f"all points share one {name}: its exponent is unidentifiable")

    des = _Design(F, S, D, L)
    names = ["e", "alpha", "kappa", "a", "b", "c"]
    free = np.array([n not in fixed and not (n == "e" and "E" in fixed) for n in names])

    def pin(th: np.ndarray) -> np.ndarray:            # put the fixed values into a centred vector
        th = th.copy()
        for i, n in enumerate(names[3:], start=3):
            if n in fixed:
                th[i] = fixed[n]
        if "E" in fixed:
            th[0] = math.log(fixed["E"])
        return th

    def f_and_g(u: np.ndarray, th0: np.ndarray) -> tuple[float, np.ndarray]:
        th = th0.copy(); th[free] = u
        logLhat, jac = des.log_model(th)
        r = logLhat - des.logL                                        # (N,) log-loss residuals
        obj = _huber(r, delta).sum() / delta ** 2
        return float(obj), jac[:, free].T @ (np.clip(r, -delta, delta) / delta ** 2)

    bounds = [(None, None)] * 3 + [BOUNDS[n] for n in EXPONENTS]
    bounds = [bd for bd, f in zip(bounds, free) if f]
    starts = [pin(th) for th in _starts(des, L, "b" not in fixed)]
    if n_starts is not None:                          # score every grid start cheaply, keep the best
        scores = [f_and_g(th[free], th)[0] for th in starts]
        starts = [starts[i] for i in np.argsort(scores)[:n_starts]]
    starts = [pin(des.to_theta(co)) for co in init] + starts
    best = None
    one_thread = threadpool_limits(1) if threadpool_limits is not None else nullcontext()
    with np.errstate(over="ignore", under="ignore"), one_thread:
        for th0 in starts:
            res = minimize(f_and_g, th0[free], args=(th0,), jac=True, method="L-BFGS-B", bounds=bounds,
                           options={"maxiter": maxiter, "ftol": 1e-15, "gtol": 1e-10})
            if np.isfinite(res.fun) and (best is None or res.fun < best[0].fun):
                th = th0.copy(); th[free] = res.x
                best = (res, th)
        if best is None:
            raise ValueError("the fit failed from every start (non-finite objective)")
        res, th = best
        co = des.to_coeffs(th)
        if not all(np.isfinite(list(asdict(co).values()))):
            raise ValueError(f"the fit produced non-finite coefficients: {co}")
        logLhat, jac = des.log_model(th)
        se_free = _gauss_newton_se(jac[:, free], logLhat - des.logL, rules.max_cond)
    # Not converged = stopped by the iteration / evaluation limit (status 1) with a projected gradient
    # that is not small.  A line search that stalls ("ABNORMAL", status 2) is a minimum here: the
    # Huber objective in its linear region has kinks at |r| = delta where the gradient jumps, and
    # from such points L-BFGS-B finds no descent (measured: the same objective, to 1e-18, as a
    # 24-start fit that ended with success).
    g = np.asarray(res.jac, dtype=float).copy()
    lo = np.array([-np.inf if bd[0] is None else bd[0] for bd in bounds])
    hi = np.array([np.inf if bd[1] is None else bd[1] for bd in bounds])
    g[((res.x <= lo) & (g > 0)) | ((res.x >= hi) & (g < 0))] = 0.0        # pressing on a bound is fine
    converged = bool(res.success or res.status == 2 or np.abs(g).max() <= 1e-5 * max(1.0, abs(res.fun)))
    if not converged:
        warnings.warn(f"L-BFGS-B did not converge: {res.message}", stacklevel=2)
    se = {n: float(s) for n, s in zip([n for n, f in zip(names, free) if f], se_free) if n in EXPONENTS}
    rmse = float(np.sqrt(np.mean((loss(co, F, S, D) - L) ** 2)))
    out = FitResult(co, rmse, huber_objective(co, F, S, D, L, delta), converged, len(L), fixed, se, _ranges(F, S, D))
    out.why = identify(out, rules)
    return out


def fit(F, S, D, L, **opts) -> Coeffs:
    """Fit SMELT Eq. 2 to points (F FLOPs/token, S fraction, D tokens, L nats); all 1-D, same length.

    Huber (delta 1e-3) on log-loss, L-BFGS-B from a grid of starts; returns the best Coeffs.
    opts: fixed={"b": 0.0} pins coefficients (E, a, b, c); delta; init=[Coeffs, ...] extra starts;
    n_starts (grid starts that get a full L-BFGS-B run; None = all); maxiter; rules.
    Use `fit_result` for the RMSE (nats), objective, convergence and whether the fit is identified.
    """
    return fit_result(F, S, D, L, **opts).coeffs


# ----------------------------------------------------------------------------- Eqs. 3-5
def _check_budget(C, S, co: Coeffs | None = None) -> tuple[np.ndarray, np.ndarray]:
    if co is not None and not (co.a > 0 and co.c > 0):
        raise ValueError(f"a compute-optimal frontier needs a > 0 and c > 0; got a = {co.a}, c = {co.c}")
    C, S = np.asarray(C, dtype=float), np.asarray(S, dtype=float)
    if np.any(~np.isfinite(C)) or np.any(C <= 0):
        raise ValueError(f"compute C must be positive and finite; got {C}")
    if np.any(~np.isfinite(S)) or np.any(S >= 1):
        raise ValueError(f"sparsity S must be a finite fraction < 1; got {S}")
    return C, S


def optimal_flops_per_token(co: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 3: F* = (a A (1-S)^b C^c / (c K))^(1/(a+c)) minimises Eq. 2 subject to F * D = C."""
    C, S = _check_budget(C, S, co)
    if min(co.A, co.K, co.a, co.c) <= 0:
        raise ValueError(f"degenerate surface (A, K, a and c must be > 0 for a frontier): {co}")
    logF = (math.log(co.a * co.A / (co.c * co.K)) + co.b * np.log1p(-S) + co.c * np.log(C)) / (co.a + co.c)
    return np.exp(logF)[()]


def frontier_loss(co: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 4: L*(C, S) = E + prefactor * C^-gamma, gamma = ac/(a+c).

    At F* the data term equals (a/c) times the capacity term, so L* = E + (1 + a/c) A (1-S)^b F*^-a.
    """
    F = optimal_flops_per_token(co, C, S)
    return (co.E + (1 + co.a / co.c) * co.A * (1 - np.asarray(S, dtype=float)) ** co.b / F ** co.a)[()]


def compute_for_loss(co: Coeffs, L, S) -> float | np.ndarray:
    """Inverse of Eq. 4: the budget C at which the frontier reaches loss L (inf if L <= E)."""
    gamma = co.a * co.c / (co.a + co.c)
    prefactor = frontier_loss(co, 1.0, S) - co.E                      # L* - E at C = 1
    with np.errstate(divide="ignore", invalid="ignore"):
        C = np.where(np.asarray(L) > co.E, (prefactor / (np.asarray(L) - co.E)) ** (1 / gamma), np.inf)
    return C[()]


def ce_gain(target: Coeffs, ref: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 5: 1 - C / C_ref, C_ref the budget at which the reference frontier reaches the target's
    frontier loss at C.  A fraction (0.18 = 18 %); 1.0 (with a warning) where the target's loss is
    below the reference's floor E, which the reference never reaches."""
    C_ref = compute_for_loss(ref, frontier_loss(target, C, S), S)
    if np.any(np.isinf(C_ref)):
        warnings.warn("target frontier is below the reference floor E: CE gain -> 1", stacklevel=2)
    return (1.0 - np.asarray(C) / C_ref)[()]


def tpp(co: Coeffs, C, S) -> float | np.ndarray:
    """Compute-optimal tokens per dense-equivalent parameter, D* / (F*/6) = 6 C / F*^2."""
    F = optimal_flops_per_token(co, C, S)
    return (6.0 * np.asarray(C, dtype=float) / F ** 2)[()]


# ----------------------------------------------------------------------------- calibration of the rules
def paper_shaped_points(co: Coeffs, F_span: float, D_span: float, noise: float, seed: int = 0,
                        n_scales: int = 4, sparsities: Sequence[float] = PAPER_SPARSITIES,
                        n_horizons: int = 6) -> Points:
    """A grid shaped like SMELT's (n_scales scales x sparsities x n_horizons decay horizons) drawn from
    `co`: F from 6.6e8 up by F_span, D up to 3.2e11 and down by D_span, log-normal noise `noise`."""
    rng = np.random.default_rng(seed)
    Fs, fr = 6.6e8 * F_span ** np.linspace(0, 1, n_scales), D_span ** np.linspace(-1, 0, n_horizons)
    pts = [(F, s, 3.2e11 * f, f"{F:.3g}/{s}") for F in Fs for s in sparsities for f in fr]
    F, S, D = (np.array([p[i] for p in pts]) for i in range(3))
    L = loss(co, F, S, D) * np.exp(noise * rng.standard_normal(len(F)))
    return Points(F, S, D, L, np.array([p[3] for p in pts]))


def calibrate_rules(F_spans=(1.5, 2, 3, 5, 16), D_spans=(1.5, 2, 4, 10), noises=(0.003, 0.01, 0.03),
                    seeds: int = 5, rules: Rules = RULES, n_starts: int = 8) -> list[dict]:
    """The measurement behind `Rules`: on paper-shaped grids drawn from SMELT's two Table 4.3
    surfaces, fit both and record whether both fits are identified, the exponent errors and the
    error of the CE gain at S = 0.95 at the data's geometric-midpoint budget.  One dict per
    (F_span, D_span, noise, seed).  The full default grid takes ~2-8 minutes on one core."""
    out = []
    for Fs, Ds, noise, seed in product(F_spans, D_spans, noises, range(seeds)):
        res = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, (name, co) in enumerate((("smelt", PAPER_SMELT), ("baseline", PAPER_BASELINE))):
                p = paper_shaped_points(co, Fs, Ds, noise, seed=seed + 1000 * k)
                res[name] = fit_result(p.F, p.S, p.D, p.L, n_starts=n_starts, rules=rules)
            C = math.sqrt(res["baseline"].ranges["C"][0] * res["baseline"].ranges["C"][1])
            try:
                g = float(ce_gain(res["smelt"].coeffs, res["baseline"].coeffs, C, 0.95))
            except ValueError:                                  # an exponent at 0: no frontier at all
                g = math.nan
        truth = float(ce_gain(PAPER_SMELT, PAPER_BASELINE, C, 0.95))
        out.append({"F_span": Fs, "D_span": Ds, "noise": noise, "seed": seed,
                    "identified": all(r.identified for r in res.values()),
                    "why": sorted({w.split(":")[0] for r in res.values() for w in r.why}),
                    "a_err": max(abs(res[n].coeffs.a - co.a) for n, co in (("smelt", PAPER_SMELT), ("baseline", PAPER_BASELINE))),
                    "c_err": max(abs(res[n].coeffs.c - co.c) for n, co in (("smelt", PAPER_SMELT), ("baseline", PAPER_BASELINE))),
                    "gain": g, "gain_true": truth, "gain_err_pp": 100 * abs(g - truth)})
    return out


# ----------------------------------------------------------------------------- cell bootstrap
@dataclass
class Points:
    """One architecture's fit data: (N,) arrays and the grid cell each point belongs to."""
    F: np.ndarray; S: np.ndarray; D: np.ndarray; L: np.ndarray
    cell: np.ndarray                                   # (N,) cell ids, e.g. "t96/S~55%"

    def take(self, idx: np.ndarray) -> "Points":
        return Points(self.F[idx], self.S[idx], self.D[idx], self.L[idx], self.cell[idx])


@dataclass
class Bootstrap:
    gain: np.ndarray | None  # (n_ok, nC, nS) CE gain of target over reference (None: one surface)
    tpp: np.ndarray          # (n_ok, n_surfaces, nS) TPP at tpp_C, [target, reference]
    n_draws: int = 0
    n_failed: int = 0        # draws dropped: a refit raised, was not identified, or gave a non-finite number
    failures: dict = field(default_factory=dict)   # "surface: reason key" -> count

    @property
    def failed_share(self) -> float:
        return self.n_failed / self.n_draws if self.n_draws else 1.0

    @staticmethod
    def interval(draws: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        q = 50 * (1 - level)
        return np.percentile(draws, q, axis=0), np.percentile(draws, 100 - q, axis=0)


def _bootstrap_chunk(args) -> tuple[list, list, Counter]:
    """Worker: refit every surface on each resample in `draws` (each a list of cell ids); a draw
    fails if a refit raises, is not identified (`identify`) or gives a non-finite gain / TPP."""
    surfaces, names, draws, C, S, tpp_C, init, fit_opts = args
    index = [defaultdict(list) for _ in surfaces]            # cell id -> point indices, per surface
    for idx, p in zip(index, surfaces):
        for i, c in enumerate(p.cell):
            idx[c].append(i)
    gains, tpps, failed = [], [], Counter()
    for cells in draws:
        fits, reason = [], None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                   # a weak resample is expected, not news
            for p, idx, co, name in zip(surfaces, index, init, names):
                q = p.take(np.concatenate([idx[c] for c in cells]))
                try:
                    r = fit_result(q.F, q.S, q.D, q.L, init=[co], **fit_opts)
                except ValueError as e:
                    reason = f"{name}: refit impossible ({str(e).split(':')[0]})"
                    break
                if r.why:
                    reason = f"{name}: {r.why[0].split(':')[0]}"
                    break
                if set(r.fixed) != set(fit_opts.get("fixed", {})):     # b pinned: the resample has one S
                    reason = f"{name}: sparsity range"
                    break
                fits.append(r.coeffs)
            if reason is None:
                g = ce_gain(fits[0], fits[1], C[:, None], S[None, :]) if len(fits) == 2 else None   # (nC, nS)
                t = np.array([tpp(f, tpp_C, S) for f in fits])                                      # (n_surf, nS)
                if not (np.isfinite(t).all() and (g is None or np.isfinite(g).all())):
                    reason = "non-finite gain or TPP"
        if reason is None:
            gains.append(g); tpps.append(t)
        else:
            failed[reason] += 1
    return gains, tpps, failed


def cell_bootstrap(target: Points, ref: Points | None, C, S, *, tpp_C: float = 1e21, n_draws: int = 2000,
                   seed: int = 0, n_jobs: int = 2, init: tuple | None = None,
                   names: tuple[str, str] = ("target", "reference"), **fit_opts) -> Bootstrap:
    """SMELT 4.3 brackets: resample grid cells (all of a cell's points move together) with
    replacement, the same cells for both surfaces, refit both, and record the CE gain at every
    (C, S) and both surfaces' TPP at (tpp_C, S).  ref=None bootstraps one surface (TPP only).
    Each refit starts from `init` (default: the full-data fits) plus the best `n_starts` (default 4)
    grid starts.  A draw whose refit raises or is not identified is counted in n_failed (by reason
    in `failures`) and dropped.  Draws are generated up front: the result does not depend on n_jobs."""
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1; got {n_draws}")
    surfaces = [target] if ref is None else [target, ref]
    cells = sorted(set(target.cell))
    if ref is not None and set(ref.cell) != set(cells):
        raise ValueError(f"target and reference must cover the same cells; differ in "
                         f"{sorted(set(ref.cell) ^ set(cells))}")
    C, S = (np.atleast_1d(x).astype(float) for x in _check_budget(C, S))
    if init is None:
        init = tuple(fit(p.F, p.S, p.D, p.L, **{k: v for k, v in fit_opts.items() if k == "fixed"})
                     for p in surfaces)
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
    gains = [g for p in parts for g in p[0]]
    tpps = [t for p in parts for t in p[1]]
    failures = sum((p[2] for p in parts), Counter())
    n_failed = sum(failures.values())
    if n_failed:
        warnings.warn(f"{n_failed} of {n_draws} bootstrap draws failed to refit to identified surfaces "
                      f"and were dropped: {dict(failures)}", stacklevel=2)
    nS, nC = len(S), len(C)
    gain = None if ref is None else (np.array(gains) if gains else np.empty((0, nC, nS)))
    return Bootstrap(gain, np.array(tpps) if tpps else np.empty((0, len(surfaces), nS)), n_draws, n_failed,
                     dict(failures))


# ----------------------------------------------------------------------------- per-subset fits (SMELT 5.2)
def fit_subsets(subsets: Mapping[str, Points], shared: Coeffs, **opts) -> dict[str, Coeffs]:
    """Per subset (domain or source), fit only (E, A, K); the exponents (a, b, c) stay those of
    the aggregate fit `shared`, since one subset is too little data for all six."""
    pinned = {"a": shared.a, "b": shared.b, "c": shared.c}
    opts.setdefault("n_starts", 4)                    # three free intercepts, started from `shared`: easy
    return {name: fit(p.F, p.S, p.D, p.L, fixed=pinned, init=[shared], **opts) for name, p in subsets.items()}


def subset_ce_gains(target: Mapping[str, Coeffs], ref: Mapping[str, Coeffs], C: float,
                    S: float) -> dict[str, float]:
    """CE gain (Eq. 5) per subset present in both fits (SMELT uses C = 1e21, S ~ 95 %); a subset whose
    intercept fit is degenerate (A or K at 0: no frontier) is left out with a warning."""
    out = {}
    for k in target:
        if k in ref:
            try:
                out[k] = float(ce_gain(target[k], ref[k], C, S))
            except ValueError as e:
                warnings.warn(f"CE gain for subset {k!r} left out: {e}")
    return out


def quartile_gains(gain: Mapping[str, float], baseline_losses: Sequence[Mapping[str, float]],
                   n_groups: int = 4) -> np.ndarray:
    """SMELT 5.2 'by Baseline loss': in each matched pair (one dict source -> Baseline loss), rank the
    sources by loss and split them into n_groups near-equal groups (39 -> 10, 10, 10, 9; Q1 = lowest
    loss); average the per-source gains within each group, then over pairs.  -> (n_groups,)"""
    per_pair = []
    for losses in baseline_losses:
        names = sorted((s for s in losses if s in gain), key=lambda s: losses[s])
        if len(names) < n_groups:
            raise ValueError(f"{len(names)} sources with a gain cannot fill {n_groups} groups")
        per_pair.append([np.mean([gain[s] for s in grp]) for grp in np.array_split(np.array(names), n_groups)])
    if not per_pair:
        raise ValueError("no Baseline per-source losses to rank")
    return np.mean(per_pair, axis=0)


# ----------------------------------------------------------------------------- results rows -> arrays
REQUIRED_KEYS = ("arch", "scale", "sparsity_label", "F", "S", "D", "val_loss")


def read_results(path: str) -> list[dict]:
    """train.py's results rows: each row's hash checked and the keys this module needs present
    (train.read_jsonl, the one reader of JSON-lines files); a bad line is a ValueError naming it."""
    import train
    try:
        return train.read_jsonl(path, REQUIRED_KEYS)
    except train.CheckpointError as e:
        raise ValueError(str(e)) from None


def check_rows(rows: Sequence[dict]) -> None:
    """Every row a dict with REQUIRED_KEYS, F, D, val_loss finite and > 0, S finite in [0, 1) (control
    cells: [-0.5, 1));
    the error names the row (index, arch, scale, sparsity label) and the field."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError("rows must be a non-empty list of results rows (dicts)")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"rows[{i}] is not a dict: {type(r).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in r]
        if missing:
            raise ValueError(f"rows[{i}] misses keys {missing}")
        where = f"rows[{i}] ({r['arch']} {r['scale']} {r['sparsity_label']})"
        for k in ("F", "S", "D", "val_loss"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {k} = {v!r} is not a finite number")
        for k in ("F", "D", "val_loss"):
            if r[k] <= 0:
                raise ValueError(f"{where}: {k} = {r[k]!r} must be > 0")
        # a control cell's looped model may measure S slightly below 0 (matching moves its FLOPs by up to
        # 4 %); control rows are not fitted (unless include_dense), so only sparse rows need S in [0, 1)
        lo = -0.5 if r["sparsity_label"] == CONTROL_LABEL else -S_ROUNDING
        if not lo <= r["S"] < 1:
            raise ValueError(f"{where}: S = {r['S']!r} must lie in [{0 if lo > -0.5 else lo}, 1) (a fraction)")


def cell_id(row: dict) -> str:
    return f"{row['scale']}/{row['sparsity_label']}"


def to_points(rows: Sequence[dict], losses: Sequence[float] | None = None) -> Points:
    """Rows -> Points; `losses` overrides row["val_loss"] (per-subset fits)."""
    L = [r["val_loss"] for r in rows] if losses is None else losses
    cell = np.array([cell_id(r) for r in rows])
    F, S, D, L = _check_points([r["F"] for r in rows], [r["S"] for r in rows], [r["D"] for r in rows], L)
    return Points(F, S, D, L, cell)


def subset_points(rows: Sequence[dict], key: str) -> dict[str, Points]:
    """Per-subset Points from row[key] = {subset: loss} ("val_loss_by_source" / "_by_domain")."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        for name, value in (r.get(key) or {}).items():
            by[name].append((r, value))
    return {name: to_points([r for r, _ in rv], [v for _, v in rv]) for name, rv in sorted(by.items())}


def split_control(rows: Sequence[dict], include_dense: bool = False) -> tuple[list[dict], list[dict]]:
    """(rows to fit, control rows left out): the control is every row whose sparsity_label is
    CONTROL_LABEL, for both architectures, whatever S it measures (OWNERS.md).  include_dense
    keeps them in the fit (and returns no control rows)."""
    control = [r for r in rows if r["sparsity_label"] == CONTROL_LABEL]
    if include_dense:
        return list(rows), []
    return [r for r in rows if r["sparsity_label"] != CONTROL_LABEL], control


# ----------------------------------------------------------------------------- extrapolation and formatting
def frontier_extrapolation(co: Coeffs, C: float, S: float, ranges: Mapping, who: str) -> list[str]:
    """Why the frontier point of `co` at budget C is an extrapolation of its data (`ranges` from
    FitResult.ranges): C outside the data's compute, or the compute-optimal F* or D* = C / F*
    outside the data's F or D.  [] when inside."""
    out = []
    F = float(optimal_flops_per_token(co, C, S))
    for k, v, name in (("C", C, "budget C"), ("F", F, "optimal F*"), ("D", C / F, "optimal D*")):
        lo, hi = ranges[k]
        if not lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
            out.append(f"{who}: {name} = {_g(v)} outside its data's {k} ({_g(lo)} to {_g(hi)})")
    return out


def gain_cell(target: Coeffs, ref: Coeffs, C: float, S: float, rt: Mapping, rr: Mapping,
              names: tuple[str, str]) -> dict:
    """One CE gain (Eq. 5) with its extrapolation flags: {"gain" (fraction or None below GAIN_FLOOR),
    "pct" (percent or None), "C_ref", "extrapolated", "extrapolation" [reasons]}."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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


def _pct(g: float | None, nd: int = 1) -> str:
    """A gain (fraction) as a signed percentage with at most 4 integer digits."""
    if g is None or g < GAIN_FLOOR:
        return "< -9999"
    return f"{100 * g:+.{nd}f}"


def _interval(point: float | None, draws: np.ndarray, bs: Bootstrap, n_units: int, rules: Rules,
              fraction: bool = True) -> dict:
    """Bootstrap fields for one cell: {"interval": stats.Interval dict or None, "interval_why",
    "n_draws", "n_failed", "failed_share"}.  Percentiles of the draws that refit."""
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
        lo, hi = (float(x) for x in Bootstrap.interval(draws))
        if fraction and lo < GAIN_FLOOR:
            out["interval_why"] = f"lower bound {_pct(lo)} %: beyond -9999 % the interval carries no information"
        else:
            out["interval"] = stats.Interval(float(point), lo, hi, n_units, 0.95, "cell bootstrap (refit)").to_dict()
    return out


def _tpp_text(x: float) -> str:
    """TPP as an integer between 10 and 1e6, else 3 significant digits (never a long number)."""
    return f"{x:.0f}" if 10 <= x < 1e6 else f"{x:.3g}"


# ----------------------------------------------------------------------------- tables
def format_table(title: str, row_names: Sequence[str], col_names: Sequence[str], cells) -> str:
    """A small markdown table; cells is a (rows, cols) nested list of strings."""
    lines = [f"### {title}", "", "| | " + " | ".join(col_names) + " |", "|---" * (len(col_names) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(row) + " |" for name, row in zip(row_names, cells)]
    return "\n".join(lines) + "\n"


def paper_tables() -> str:
    """SMELT Tables 4.3 (CE gain, TPP at 1e21) recomputed from the printed coefficients."""
    cols = [f"S = {round(100 * s)} %" for s in PAPER_SPARSITIES]
    gain = [[f"{100 * ce_gain(PAPER_SMELT, PAPER_BASELINE, C, s):.1f} (paper {p:.1f})"
             for s, p in zip(PAPER_SPARSITIES, PAPER_CE_GAIN_PCT[C])] for C in PAPER_BUDGETS]
    tp = [[f"{tpp(co, 1e21, s):.0f} (paper {p})" for s, p in zip(PAPER_SPARSITIES, PAPER_TPP_1E21[arch])]
          for arch, co in (("baseline", PAPER_BASELINE), ("smelt", PAPER_SMELT))]
    note = ("Recomputed from the coefficients as printed in SMELT Table 4.3. The CE gain moves by up to\n"
            "~1 pp within the rounding of those coefficients, so entries can differ from the paper's by ~0.1 pp.\n")
    return (format_table("CE gain of SMELT over Baseline (%)", [f"C = {C:.0e}" for C in PAPER_BUDGETS], cols, gain)
            + "\n" + format_table("TPP at C = 1e21", ["Baseline", "SMELT"], cols, tp) + "\n" + note)


# ----------------------------------------------------------------------------- plots
def _log_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = math.log10(float(np.min(x))), math.log10(float(np.max(x)))
    d = max(hi - lo, 0.2) * pad
    return 10 ** (lo - d), 10 ** (hi + d)


def _lin_limits(x: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = float(np.min(x)), float(np.max(x))
    d = max(hi - lo, 1e-3 * max(abs(hi), 1.0)) * pad
    return lo - d, hi + d


def _reason_title(head: str, why: Sequence[str], width: int = 60) -> str:
    body = "; ".join(why[:2]) + (f"; +{len(why) - 2} more" if len(why) > 2 else "")
    return head + "\n" + "\n".join(textwrap.wrap(body, width))


def _cell_curves(co: Coeffs, p: Points):
    """Per cell: (C, L_hat) along the cell's own D range at its mean F and S (the fit on the data)."""
    for c in sorted(set(p.cell)):
        m = p.cell == c
        D = np.geomspace(p.D[m].min(), p.D[m].max(), 20)
        F, S = float(np.exp(np.log(p.F[m]).mean())), float(p.S[m].mean())
        yield c, F * D, loss(co, F, S, D)


def _plot(out: str, pts: dict, control: dict, fits: dict, why: dict, cols: dict,
          gain_plot: dict | None, names: tuple[str, str]) -> list[str]:
    """loss_vs_compute.png (data, and each identified fit along every cell's own D range),
    reducible_loss.png (SMELT Fig. 9, identified fits only) and ce_gain.png (both identified).
    Axes span the data, never the paper's budgets.  Returns the file names written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    colours = dict(zip(cols, plt.cm.viridis(np.linspace(0, 0.85, max(len(cols), 1)))))
    label_of = lambda p: np.array([c.split("/", 1)[1] for c in p.cell])        # sparsity label per point
    archs = sorted(set(pts) | set(control))
    allC = np.concatenate([p.F * p.D for d in (pts, control) for p in d.values()])
    allL = np.concatenate([p.L for d in (pts, control) for p in d.values()])
    xlim, ylim = _log_limits(allC), _lin_limits(allL)
    fig, axes = plt.subplots(1, len(archs), figsize=(5.8 * len(archs), 4.6), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        p = pts.get(arch)
        if p is not None:
            for lab in cols:
                m = label_of(p) == lab
                ax.scatter(p.F[m] * p.D[m], p.L[m], color=colours[lab], s=18, label=lab, zorder=3)
            if arch in fits:
                for cell, C, Lh in _cell_curves(fits[arch], p):
                    ax.plot(C, Lh, color=colours[cell.split("/", 1)[1]], lw=1, alpha=0.8)
        if arch in control:
            q = control[arch]
            ax.scatter(q.F * q.D, q.L, facecolors="none", edgecolors="0.5", s=22,
                       label=f"{CONTROL_LABEL} control (left out of the fit)", zorder=3)
        if arch in fits:
            title = f"{arch}: Eq. 2 fit (lines: each cell along its D)"
        elif p is None:
            title = f"{arch}: control cells only (nothing fitted)"
        else:
            title = _reason_title(f"{arch}: data only, fit not identified", why.get(arch, []))
        ax.set(xscale="log", xlim=xlim, ylim=ylim, xlabel="training compute C = F D (FLOPs)",
               ylabel="validation loss (nats)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(os.path.join(out, "loss_vs_compute.png"), dpi=120); plt.close(fig)
    written.append("loss_vs_compute.png")

    ident = [a for a in sorted(fits) if a in pts]
    if ident and cols:                                   # SMELT Fig. 9: L - E on the sparse grid
        fig, axes = plt.subplots(1, len(cols), figsize=(4.8 * len(cols), 4.2), squeeze=False)
        for ax, (lab, s) in zip(axes[0], cols.items()):
            ys, dropped = [], 0
            for i, arch in enumerate(ident):
                p, co, col = pts[arch], fits[arch], f"C{i}"
                m = label_of(p) == lab
                r = p.L[m] - co.E
                dropped += int((r <= 0).sum())
                ok = r > 0
                ax.scatter((p.F[m] * p.D[m])[ok], r[ok], marker="os^v"[i % 4], s=18, label=arch,
                           edgecolors=col, facecolors="none" if i == 0 else col, zorder=3)
                ys.append(r[ok])
                for cell, C, Lh in _cell_curves(co, p.take(np.flatnonzero(m))):
                    ax.plot(C, Lh - co.E, color=col, lw=1, alpha=0.8)
                Cg = np.geomspace(*fits_range(p), 30)
                fr = frontier_loss(co, Cg, s) - co.E
                ax.plot(Cg, fr, color=col, ls="--", lw=1, label=f"{arch} frontier L* - E")
                ys.append(fr)
            y = np.concatenate(ys) if ys else np.array([1.0])
            y = y[y > 0] if (y > 0).any() else np.array([1.0])
            ax.set(xscale="log", yscale="log", xlim=xlim, ylim=_log_limits(y), xlabel="C (FLOPs)",
                   ylabel="L - E (nats, each fit's own E)")
            ax.set_title(f"{lab}: reducible loss" + (f" ({dropped} points below E not shown)" if dropped else ""),
                         fontsize=9)
            ax.legend(fontsize=7)
        missing = sorted(set(pts) - set(ident))
        if missing:
            fig.suptitle(f"not drawn (fit not identified): {', '.join(missing)}", fontsize=9)
        fig.tight_layout(); fig.savefig(os.path.join(out, "reducible_loss.png"), dpi=120); plt.close(fig)
        written.append("reducible_loss.png")

    if gain_plot is not None:
        Cg, g, ext, band = gain_plot["C"], gain_plot["pct"], gain_plot["extrapolated"], gain_plot.get("band")
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        lo_show, clipped = -300.0, False
        for j, lab in enumerate(cols):
            y = np.where(np.isfinite(g[:, j]), g[:, j], np.nan)
            ins = ~ext[:, j]
            ax.plot(Cg, np.where(ins, y, np.nan), color=colours[lab], label=f"{lab}")
            near = ext[:, j].copy()                          # dotted where extrapolated, joined to the solid part
            near[1:] |= ext[:-1, j]; near[:-1] |= ext[1:, j]
            ax.plot(Cg, np.where(near, y, np.nan), color=colours[lab], ls=":")
            if band is not None:
                ax.fill_between(Cg, np.maximum(band[0][:, j], lo_show), band[1][:, j], color=colours[lab], alpha=0.2)
                clipped |= bool((band[0][:, j] < lo_show).any())
        ax.axhline(0, color="0.4", lw=0.8)
        vals = [g[np.isfinite(g)]] + ([np.maximum(band[0], lo_show).ravel(), band[1].ravel()] if band is not None else [])
        v = np.concatenate(vals) if vals else np.array([0.0])
        ax.set_ylim(*_lin_limits(np.concatenate([v, [0.0]])))
        ax.set(xscale="log", xlim=_log_limits(Cg, 0.02), xlabel=f"{names[0]} compute C (FLOPs), over both fits' common compute range",
               ylabel="CE gain (% of reference compute saved)")
        t = f"CE gain of {names[0]} over {names[1]} on the frontier"
        if band is not None:
            t += f"\nband: 95 % cell bootstrap, {100 * gain_plot['failed_share']:.0f} % of draws failed"
        if clipped:
            t += f"; band clipped at {lo_show:.0f} %"
        if ext.any():
            t += "\ndotted: extrapolated (see tables.json)"
        ax.set_title(t, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout(); fig.savefig(os.path.join(out, "ce_gain.png"), dpi=120); plt.close(fig)
        written.append("ce_gain.png")
    return written


def fits_range(p: Points) -> tuple[float, float]:
    C = p.F * p.D
    return float(C.min()), float(C.max())


# ----------------------------------------------------------------------------- analyse
def _fit_entry(res: FitResult | None, p: Points | None, why: list[str], cells: list[str]) -> dict:
    """What the report may print about one architecture: data facts always, coefficients only when
    identified."""
    e = {"identified": res is not None and not why, "why": list(why), "n_points": 0 if p is None else len(p.L),
         "cells": cells}
    if p is not None:
        e["ranges"] = {k: list(v) for k, v in _ranges(p.F, p.S, p.D).items()}
    if e["identified"]:
        co = res.coeffs
        e.update(asdict(co))
        e.update(se={k: v for k, v in res.se.items()}, gamma=co.a * co.c / (co.a + co.c), rmse_nats=res.rmse,
                 objective=res.objective, converged=res.converged, fixed=dict(res.fixed))
    return e


def _why_text(why: Sequence[str]) -> str:
    return "not identified (" + "; ".join(why) + ")"


def _why_short(why: Sequence[str]) -> str:
    """The reason keys only, for tables after the first (which prints them in full)."""
    keys = list(dict.fromkeys(w.split(":")[0] for w in why))
    return "not identified (" + ", ".join(keys) + "; details in the coefficients table)"


def _subset_report(by_arch, fits, cols, C, target, ref, rules) -> tuple[dict, dict, list[str]]:
    """SMELT 5.2 on the rows' per-domain and per-source losses: intercept fits with the aggregate
    exponents (each must pass `identify`), CE gain at budget C for every sparsity column with
    extrapolation flags, and the Baseline-loss quartiles at the middle sparsity column."""
    report, md = {}, []
    quart = {"available": False, "why": ["no per-source losses in the rows"]}
    labs = list(cols)
    for key in ("val_loss_by_domain", "val_loss_by_source"):
        sub = {a: subset_points(by_arch[a], key) for a in (target, ref)}
        names = sorted(set(sub[target]) & set(sub[ref]))
        if not names:
            continue
        sf, rg, not_fitted = {target: {}, ref: {}}, {target: {}, ref: {}}, {}
        for name in names:
            try:
                for a in (target, ref):
                    p, sh = sub[a][name], fits[a]
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        r = fit_result(p.F, p.S, p.D, p.L, fixed={"a": sh.a, "b": sh.b, "c": sh.c},
                                       init=[sh], n_starts=4, rules=rules)
                    if r.why:
                        raise ValueError(f"{a}: " + "; ".join(r.why))
                    sf[a][name], rg[a][name] = r.coeffs, r.ranges
            except ValueError as e:
                not_fitted[name] = str(e)
        ok = [n for n in names if n not in not_fitted]
        gains = {n: {lab: gain_cell(sf[target][n], sf[ref][n], C, s, rg[target][n], rg[ref][n], (target, ref))
                     for lab, s in cols.items()} for n in ok}
        report[key] = {"budget": C, "gains": gains, "not_fitted": not_fitted}
        what = key.removeprefix("val_loss_by_")
        if ok:
            md.append(format_table(f"CE gain (%) of {target} over {ref} by {what} at C = {C:.2e}", ok, labs,
                                   [[_pct(gains[n][lab]["gain"]) + ("†" if gains[n][lab]["extrapolated"] else "")
                                     for lab in labs] for n in ok]))
        if not_fitted:
            md.append(f"Not fitted ({what}): " + "; ".join(f"{n}: {w}" for n, w in not_fitted.items()) + "\n")
        if key == "val_loss_by_source":
            lab = labs[len(labs) // 2]
            g = {n: gains[n][lab]["gain"] for n in ok}
            losses = [r[key] for r in by_arch[ref] if r.get(key)]
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
                    continue
                quart.update(available=True, why=[], gain=q.tolist(), pct=(100 * q).tolist(),
                             extrapolated=any(gains[n][lab]["extrapolated"] for n in ok))
                md.append(format_table(f"CE gain (%) by Baseline-loss quartile ({lab}, C = {C:.2e})", ["CE gain"],
                                       [f"Q{i + 1}" for i in range(len(q))],
                                       [[_pct(x) + ("†" if quart["extrapolated"] else "") for x in q]]))
    return report, quart, md


def analyse(rows: Sequence[dict], out: str, *, n_boot: int = 2000, n_jobs: int = 2, seed: int = 0,
            include_dense: bool = False, budgets: Sequence[float] | None = None,
            target: str = "smelt", ref: str = "baseline", rules: Rules = RULES) -> dict:
    """Fit every architecture in `rows` (train.py's results rows), decide whether each fit is
    identified, and only from identified fits derive CE gains (target over ref), TPP, bootstrap
    intervals, per-subset gains and quartiles.  Writes coeffs.json, tables.json, tables.md and the
    plots to `out`, and returns (the report prints from it without further checks):

      control_label, include_dense, n_rows, n_control_rows, unmatched_cells   (which rows were fitted)
      fits[arch]     identified, why, n_points, cells, ranges {F, D, C, one_minus_S: [lo, hi]};
                     only when identified: E A K a b c, se {a, b, c}, gamma, rmse_nats, objective,
                     converged, fixed
      sparsity       {label: mean measured S} (the columns), budgets, budget_source ("data" | "given"),
                     compute_window [lo, hi] (both archs' C overlap) or None, tpp_budget
      gains          {available, why, target, ref, cells: [{budget, sparsity_label, S, gain, pct, C_ref,
                     extrapolated, extrapolation, interval (stats.Interval dict) | None, interval_why,
                     n_draws, n_failed, failed_share, text}]}
      tpp[arch]      {available, why, budget, cells: [{sparsity_label, S, tpp, extrapolated,
                     extrapolation, interval, interval_why, n_draws, n_failed, failed_share, text}]}
      bootstrap      {n_draws, n_failed, failed_share, failures {reason: count}} per bootstrap run
                     ("pair" for target+ref, or an arch name), {} when none ran
      subsets, quartiles, figures, tables_md
    """
    check_rows(rows)
    if target == ref:
        raise ValueError(f"target and ref must differ; both are {target!r}")
    fit_rows, control_rows = split_control(rows, include_dense)
    os.makedirs(out, exist_ok=True)
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
    # control points are only drawn (hollow), never fitted: a looped control's slightly negative S is clipped
    control = {a: to_points([{**r, "S": max(float(r["S"]), 0.0)} for r in rs])
               for a in archs if (rs := [r for r in control_rows if r["arch"] == a])}
    by_label: dict[str, list] = defaultdict(list)
    for a, rs in by_arch.items():
        for r in rs:
            by_label[str(r["sparsity_label"])].append(max(float(r["S"]), 0.0))
    cols = dict(sorted(((k, float(np.mean(v))) for k, v in by_label.items()), key=lambda kv: kv[1]))
    S_arr = np.array(list(cols.values()))

    results, why = {}, {}
    for a in archs:
        p = pts.get(a)
        if p is None:
            had = any(r["arch"] == a for r in fit_rows)
            why[a] = ([f"no rows to fit: no cell shared with {ref if a == target else target}"] if had else
                      [f"no rows to fit: only {CONTROL_LABEL} control cells"] if a in control else ["no rows to fit"])
            continue
        fixed = {"b": 0.0} if len({r["sparsity_label"] for r in by_arch[a]}) == 1 else {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[a] = fit_result(p.F, p.S, p.D, p.L, fixed=fixed, rules=rules)
            why[a] = results[a].why
        except ValueError as e:
            why[a] = [f"fit impossible: {e}"]
    fits = {a: r.coeffs for a, r in results.items() if not why[a]}
    ranges = {a: r.ranges for a, r in results.items()}
    report: dict = {"control_label": CONTROL_LABEL, "include_dense": include_dense, "n_rows": len(rows),
                    "n_control_rows": len(control_rows), "unmatched_cells": unmatched,
                    "fits": {a: _fit_entry(results.get(a), pts.get(a), why[a], sorted({cell_id(r) for r in by_arch[a]}))
                             for a in archs},
                    "sparsity": cols}

    # budgets: the data's own compute window (overlap of the two architectures' C ranges)
    span_archs = [a for a in ((target, ref) if pair else archs) if a in pts]
    window = None
    if span_archs:
        lo = max(float((pts[a].F * pts[a].D).min()) for a in span_archs)
        hi = min(float((pts[a].F * pts[a].D).max()) for a in span_archs)
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
    report.update(budgets=budgets, budget_source=source, compute_window=None if window is None else list(window),
                  tpp_budget=tpp_C)

    # bootstrap(s): both surfaces when both are identified, else each identified one alone (TPP)
    both = pair and target in fits and ref in fits
    Cgrid = np.geomspace(window[0], window[1], 40) if (both and window is not None) else np.empty(0)
    nB = len(budgets)
    boots: dict[str, tuple] = {}                       # name -> (Bootstrap, surfaces)
    if n_boot > 0 and budgets and cols:
        Cb = np.concatenate([budgets, Cgrid])
        if both:
            boots["pair"] = (cell_bootstrap(pts[target], pts[ref], Cb, S_arr, tpp_C=tpp_C, n_draws=n_boot, seed=seed,
                                            n_jobs=n_jobs, init=(fits[target], fits[ref]), names=(target, ref),
                                            fixed=results[target].fixed, rules=rules), (target, ref))
        for a in sorted(fits):
            if not (both and a in (target, ref)):
                boots[a] = (cell_bootstrap(pts[a], None, Cb, S_arr, tpp_C=tpp_C, n_draws=n_boot, seed=seed,
                                           n_jobs=n_jobs, init=(fits[a],), names=(a, ""), fixed=results[a].fixed,
                                           rules=rules), (a,))
    report["bootstrap"] = {k: {"surfaces": list(s), "n_draws": b.n_draws, "n_failed": b.n_failed,
                               "failed_share": b.failed_share, "failures": b.failures} for k, (b, s) in boots.items()}
    no_boot = {"interval": None, "interval_why": "no bootstrap (n_boot = 0)" if n_boot <= 0 else "no bootstrap",
               "n_draws": 0, "n_failed": 0, "failed_share": None}

    # CE gains
    gains = {"available": False, "why": [], "target": target, "ref": ref, "cells": []}
    if not pair:
        gains["why"] = [f"needs rows of both {target!r} and {ref!r}"]
    elif not both:
        gains["why"] = [f"{a} {_why_text(why[a])}" for a in (target, ref) if a not in fits]
    elif not budgets:
        gains["why"] = ["the two architectures' compute ranges do not overlap: no budget inside both"]
    else:
        gains["available"] = True
        bs = boots["pair"][0] if "pair" in boots else None
        for i, C in enumerate(budgets):
            for j, (lab, s) in enumerate(cols.items()):
                cell = {"budget": C, "sparsity_label": lab, "S": s,
                        **gain_cell(fits[target], fits[ref], C, s, ranges[target], ranges[ref], (target, ref))}
                cell.update(no_boot if bs is None else
                            _interval(cell["gain"], bs.gain[:, i, j], bs,
                                      len(set(pts[target].cell)), rules))
                iv = cell["interval"]
                cell["text"] = (_pct(cell["gain"]) + (f" [{_pct(iv['lo'])}, {_pct(iv['hi'])}]" if iv else "")
                                + ("†" if cell["extrapolated"] else ""))
                gains["cells"].append(cell)
    report["gains"] = gains

    # TPP per identified architecture at the middle budget
    report["tpp"] = {}
    for a in archs:
        t = {"available": False, "why": [], "budget": tpp_C, "cells": []}
        if a not in fits:
            t["why"] = [_why_text(why[a])]
        elif tpp_C is None:
            t["why"] = ["no budget inside the data"]
        else:
            t["available"] = True
            if both and a in (target, ref) and "pair" in boots:
                bs, k = boots["pair"][0], (target, ref).index(a)
            elif a in boots:
                bs, k = boots[a][0], 0
            else:
                bs = k = None
            for j, (lab, s) in enumerate(cols.items()):
                v = float(tpp(fits[a], tpp_C, s))
                cell = {"sparsity_label": lab, "S": s, "tpp": v,
                        "extrapolation": frontier_extrapolation(fits[a], tpp_C, s, ranges[a], a)}
                cell["extrapolated"] = bool(cell["extrapolation"])
                cell.update(no_boot if bs is None else _interval(v, bs.tpp[:, k, j], bs, len(set(pts[a].cell)),
                                                                 rules, fraction=False))
                iv = cell["interval"]
                cell["text"] = (_tpp_text(v) + (f" [{_tpp_text(iv['lo'])}, {_tpp_text(iv['hi'])}]" if iv else "")
                                + ("†" if cell["extrapolated"] else ""))
                t["cells"].append(cell)
        report["tpp"][a] = t

    # per-subset gains and quartiles (SMELT 5.2): only from two identified surfaces
    md_sub = []
    if gains["available"]:
        report["subsets"], report["quartiles"], md_sub = _subset_report(by_arch, fits, cols, tpp_C, target, ref, rules)
    else:
        report["subsets"] = {}
        report["quartiles"] = {"available": False, "why": gains["why"] or ["no CE gain"]}

    # plots
    gain_plot = None
    if gains["available"] and len(Cgrid):
        cells = [[gain_cell(fits[target], fits[ref], C, s, ranges[target], ranges[ref], (target, ref))
                  for s in S_arr] for C in Cgrid]
        g = np.array([[np.nan if c["gain"] is None else 100 * c["gain"] for c in row] for row in cells])
        ext = np.array([[c["extrapolated"] for c in row] for row in cells])
        gain_plot = {"C": Cgrid, "pct": g, "extrapolated": ext}
        if "pair" in boots:
            bs = boots["pair"][0]
            if len(bs.gain) >= rules.min_ok_draws and bs.failed_share <= rules.max_failed_share:
                lo, hi = Bootstrap.interval(bs.gain[:, nB:, :])
                gain_plot.update(band=(100 * lo, 100 * hi), failed_share=bs.failed_share)
    report["figures"] = _plot(out, pts, control, fits, why, cols, gain_plot, (target, ref))

    md = _markdown(report, cols, md_sub, target, ref)
    report["tables_md"] = "tables.md"
    with open(os.path.join(out, "coeffs.json"), "w") as f:
        json.dump(report["fits"], f, indent=2)
    with open(os.path.join(out, "tables.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(md)
    return report


def _markdown(report: dict, cols: dict, md_sub: list[str], target: str, ref: str) -> str:
    """tables.md: fits (coefficients only when identified), CE gain, TPP, subsets.  No number a
    degenerate fit produced; every number has at most 8 digits."""
    labs = list(cols)
    md = ["## Scaling-law fits (SMELT Eq. 2)\n"]
    ctl = (f"The {report['n_control_rows']} rows of the `{CONTROL_LABEL}` control cells are left out of the fits "
           f"(SMELT 4.3)." if report["n_control_rows"] else
           ("The control cells are included (--include-dense)." if report["include_dense"] else "There are no control cells."))
    md.append(ctl + (f" Cells only one architecture has (left out): {', '.join(report['unmatched_cells'])}."
                     if report["unmatched_cells"] else "") + "\n")
    rows, cells = [], []
    for a, e in report["fits"].items():
        rg = e.get("ranges")
        data = [str(e["n_points"]), "–" if rg is None else f"{rg['C'][0]:.2e} to {rg['C'][1]:.2e}"]
        rows.append(a)
        if e["identified"]:
            se = e["se"]
            exp = [f"{e[k]:.4f}" + (f" ± {se[k]:.3f}" if k in se and math.isfinite(se[k]) else
                                     " (pinned)" if k in e["fixed"] else "") for k in "abc"]
            cells.append(["identified", f"{e['E']:.4f}", f"{e['A']:.4g}", f"{e['K']:.4g}", *exp,
                          f"{e['gamma']:.3f}", f"{e['rmse_nats']:.4f}", *data])
        else:
            cells.append([_why_text(e["why"]), *["–"] * 8, *data])
    md.append(format_table("Coefficients (± Gauss-Newton standard error)", rows,
                           ["status", "E", "A", "K", "a", "b", "c", "gamma", "RMSE (nats)", "points", "C range (FLOPs)"],
                           cells))
    short = {a: f"{a} {_why_short(e['why'])}" for a, e in report["fits"].items() if not e["identified"]}
    g = report["gains"]
    budgets = report["budgets"]
    g_why = [short[a] for a in (target, ref) if a in short] or g["why"]
    where = ("the data's compute window: its geometric midpoint and log-quartiles" if report["budget_source"] == "data"
             else "given budgets")
    if g["available"]:
        by = {(c["budget"], c["sparsity_label"]): c["text"] for c in g["cells"]}
        md.append(format_table(f"CE gain of {target} over {ref} (%, at {where})",
                               [f"C = {C:.2e}" for C in budgets], [f"{l} (S = {cols[l]:.2f})" for l in labs],
                               [[by[(C, l)] for l in labs] for C in budgets]))
    else:
        md.append(f"### CE gain of {target} over {ref}\n\nNot computed: {'; '.join(g_why)}.\n")
    tp_rows, tp_cells = [], []
    for a, t in report["tpp"].items():
        tp_rows.append(a)
        tp_cells.append([c["text"] for c in t["cells"]] if t["available"] else
                        [short[a].removeprefix(a + " ") if a in short else "; ".join(t["why"])] + ["–"] * (len(labs) - 1))
    if tp_rows and labs:
        C = report["tpp_budget"]
        md.append(format_table("Compute-optimal tokens per parameter, TPP" + (f" at C = {C:.2e}" if C else ""),
                               tp_rows, labs, tp_cells))
    notes = []
    for name, b in report["bootstrap"].items():
        fails = ", ".join(f"{k} ({v})" for k, v in sorted(b["failures"].items(), key=lambda kv: -kv[1]))
        notes.append(f"Bootstrap `{name}`: {b['n_draws']} cell resamples, each refitting "
                     f"{' and '.join(b['surfaces'])}; {b['n_failed']} failed ({100 * b['failed_share']:.0f} %)"
                     + (f": {fails}" if fails else "") + ".")
    if notes:
        notes.append("Brackets are the 2.5 / 97.5 percentiles of the draws that refit to identified surfaces; "
                     "a cell without brackets has none (see interval_why in tables.json).")
    if any(c.get("extrapolated") for c in g["cells"]) or any(
            c.get("extrapolated") for t in report["tpp"].values() for c in t["cells"]):
        notes.append("† extrapolated: the budget, C_ref or a compute-optimal F* / D* lies outside the data of a "
                     "fitted surface (reasons in tables.json).")
    md += [n + "\n" for n in notes]
    if md_sub:
        md.append("### Per-subset CE gain (SMELT 5.2; intercepts refitted with the aggregate exponents)\n")
        md += md_sub
    elif not g["available"]:
        md.append(f"Per-subset and quartile gains: not computed ({'; '.join(g_why)}).\n")
    return "\n".join(md)


def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser("Fit SMELT Eq. 2 loss surfaces per architecture, say whether each fit is identified, and "
                    "from identified fits report CE gain, TPP, cell-bootstrap brackets, per-subset gains and plots.")
    ap.add_argument("--results", help="results.jsonl written by train.py (one JSON row per finished run)")
    cli.add_out_dir(ap, "output directory for JSON, tables and plots", default="scaling_out")
    ap.add_argument("--bootstrap", type=cli.nonneg_int, default=2000, help="cell-bootstrap draws (0 to skip)")
    ap.add_argument("--jobs", type=cli.positive_int, default=2, help="worker processes for the bootstrap")
    cli.deprecated_alias(ap, "--n-jobs", "jobs", "--jobs", type=cli.positive_int)
    ap.add_argument("--seed", type=cli.nonneg_int, default=0, help="bootstrap seed")
    ap.add_argument("--budgets", type=cli.positive_float, nargs="+", help="compute budgets (FLOPs) for the CE-gain "
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
    analyse(read_results(args.results), args.out_dir, n_boot=args.bootstrap, n_jobs=args.jobs, seed=args.seed,
            include_dense=args.include_dense, budgets=args.budgets)
    print(open(os.path.join(args.out_dir, "tables.md")).read())


if __name__ == "__main__":
    main()
