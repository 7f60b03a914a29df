"""Scaling laws: separate loss surfaces, compute-optimal frontier, CE gain, TPP (SMELT Section 4).

What this file implements
-------------------------
* The loss surface of SMELT Eq. 2,  L(F, S, D) = E + A (1 - S)^b / F^a + K / D^c,
  with F = per-token training FLOPs, S = compute-equivalent sparsity (a fraction), D = tokens.
* `fit`: Chinchilla Approach 3 as Hoffmann et al. and Epoch AI run it: Huber loss (delta 1e-3)
  on log-loss residuals, minimised with L-BFGS-B from a grid of starting points (Section 4.3).
* The compute-optimal frontier for a budget C = F * D: F* (Eq. 3), L*(C, S) (Eq. 4, gamma =
  ac/(a+c)), the CE gain of a target over a reference (Eq. 5, by inverting the reference
  frontier) and tokens per dense-equivalent parameter TPP = D* / (F*/6).
* The cell bootstrap behind the paper's brackets (resample grid cells, refit both surfaces),
  per-subset intercept fits with shared exponents (Section 5.2), the quartile grouping by
  Baseline loss, plots, and a CLI over the results.jsonl rows that train.py writes.

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
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import minimize

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

DENSE_S = 0.01          # |S| below this is the dense control, left out of the fits by default (SMELT 4.3)
EXPONENTS = ("a", "b", "c")
BOUNDS = {"a": (0.0, 4.0), "b": (-2.0, 4.0), "c": (0.0, 4.0)}   # exponents; e/alpha/kappa are free


# ----------------------------------------------------------------------------- Eq. 2
def loss(co: Coeffs, F, S, D) -> np.ndarray:
    """SMELT Eq. 2, vectorised over broadcastable F (FLOPs/token), S (fraction < 1), D (tokens)."""
    F, S, D = (np.asarray(x, dtype=float) for x in (F, S, D))
    return co.E + co.A * (1.0 - S) ** co.b / F ** co.a + co.K / D ** co.c


def _check_points(F, S, D, L) -> tuple[np.ndarray, ...]:
    """Validate fit inputs: equal-length 1-D, finite, F, D, L > 0, S < 1.  Returns float arrays."""
    arrs = [np.asarray(x, dtype=float).ravel() for x in (F, S, D, L)]
    n = len(arrs[0])
    for name, x in zip("FSDL", arrs):
        if len(x) != n:
            raise ValueError(f"F, S, D, L must have equal lengths; {name} has {len(x)}, F has {n}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} contains NaN or inf at index {int(np.flatnonzero(~np.isfinite(x))[0])}")
    for name, x in zip("FDL", (arrs[0], arrs[2], arrs[3])):
        if np.any(x <= 0):
            raise ValueError(f"{name} must be positive; got {x.min()}")
    if np.any(arrs[1] >= 1):
        raise ValueError(f"sparsity S must be < 1 (a fraction, not a percentage); got max {arrs[1].max()}")
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
               init: Sequence[Coeffs] = (), n_starts: int | None = 24, maxiter: int = 2000) -> FitResult:
    """Fit Eq. 2 (see `fit`) and report RMSE, objective and convergence with the coefficients."""
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
    # A line search that stalls at machine precision ("ABNORMAL") is converged if the projected
    # gradient is tiny; a fit stopped at maxiter far from a stationary point is not.
    g = np.asarray(res.jac, dtype=float).copy()
    lo = np.array([-np.inf if bd[0] is None else bd[0] for bd in bounds])
    hi = np.array([np.inf if bd[1] is None else bd[1] for bd in bounds])
    g[((res.x <= lo) & (g > 0)) | ((res.x >= hi) & (g < 0))] = 0.0        # pressing on a bound is fine
    converged = bool(res.success or np.abs(g).max() <= 1e-5 * max(1.0, abs(res.fun)))
    if not converged:
        warnings.warn(f"L-BFGS-B did not converge: {res.message}", stacklevel=2)
    rmse = float(np.sqrt(np.mean((loss(co, F, S, D) - L) ** 2)))
    return FitResult(co, rmse, huber_objective(co, F, S, D, L, delta), converged, len(L), fixed)


def fit(F, S, D, L, **opts) -> Coeffs:
    """Fit SMELT Eq. 2 to points (F FLOPs/token, S fraction, D tokens, L nats); all 1-D, same length.

    Huber (delta 1e-3) on log-loss, L-BFGS-B from a grid of starts; returns the best Coeffs.
    opts: fixed={"b": 0.0} pins coefficients (E, a, b, c); delta; init=[Coeffs, ...] extra starts;
    n_starts (grid starts that get a full L-BFGS-B run; None = all); maxiter.
    Use `fit_result` for the RMSE (nats), objective and convergence flag.
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


# ----------------------------------------------------------------------------- cell bootstrap
@dataclass
class Points:
    """One architecture's fit data: (N,) arrays and the grid cell each point belongs to."""
    F: np.ndarray; S: np.ndarray; D: np.ndarray; L: np.ndarray
    cell: np.ndarray                                   # (N,) cell ids, e.g. "200M/95"

    def take(self, idx: np.ndarray) -> "Points":
        return Points(self.F[idx], self.S[idx], self.D[idx], self.L[idx], self.cell[idx])


@dataclass
class Bootstrap:
    gain: np.ndarray       # (n_draws, nC, nS) CE gain of target over reference
    tpp: np.ndarray        # (n_draws, 2, nS) TPP at tpp_C, [target, reference]
    n_failed: int          # draws whose refit raised (dropped)

    @staticmethod
    def interval(draws: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        q = 50 * (1 - level)
        return np.percentile(draws, q, axis=0), np.percentile(draws, 100 - q, axis=0)


def _bootstrap_chunk(args) -> tuple[list, list, int]:
    """Worker: refit both surfaces on each resample in `draws` (each a list of cell ids)."""
    target, ref, draws, C, S, tpp_C, init, fit_opts = args
    index = [defaultdict(list), defaultdict(list)]           # cell id -> point indices, per surface
    for idx, p in zip(index, (target, ref)):
        for i, c in enumerate(p.cell):
            idx[c].append(i)
    gains, tpps, failed = [], [], 0
    for cells in draws:
        try:
            fits = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")               # a weak resample is expected, not news
                for p, idx, co in zip((target, ref), index, init):
                    q = p.take(np.concatenate([idx[c] for c in cells]))
                    fits.append(fit(q.F, q.S, q.D, q.L, init=[co], **fit_opts))
                g = ce_gain(fits[0], fits[1], C[:, None], S[None, :])              # (nC, nS)
                t = [tpp(f, tpp_C, S) for f in fits]                               # (2, nS)
            gains.append(g); tpps.append(t)
        except ValueError:                            # e.g. a resample that pins an exponent at 0
            failed += 1
    return gains, tpps, failed


def cell_bootstrap(target: Points, ref: Points, C, S, *, tpp_C: float = 1e21, n_draws: int = 2000,
                   seed: int = 0, n_jobs: int = 2, init: tuple[Coeffs, Coeffs] | None = None,
                   **fit_opts) -> Bootstrap:
    """SMELT 4.3 brackets: resample grid cells (all of a cell's points move together) with
    replacement, the same cells for both surfaces, refit both, and record the CE gain at every
    (C, S) and both surfaces' TPP at (tpp_C, S).  Each refit starts from `init` (default: the
    full-data fits) plus the best `n_starts` (default 4) grid starts.  Draws are generated up front,
    so the result does not depend on n_jobs."""
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1; got {n_draws}")
    cells = sorted(set(target.cell))
    if set(ref.cell) != set(cells):
        raise ValueError(f"target and reference must cover the same cells; differ in "
                         f"{sorted(set(ref.cell) ^ set(cells))}")
    C, S = (np.atleast_1d(x).astype(float) for x in _check_budget(C, S))
    if init is None:
        init = (fit(target.F, target.S, target.D, target.L), fit(ref.F, ref.S, ref.D, ref.L))
    fit_opts.setdefault("n_starts", 4)
    rng = np.random.default_rng(seed)
    draws = [[cells[i] for i in rng.integers(0, len(cells), len(cells))] for _ in range(n_draws)]
    chunks = np.array_split(np.arange(n_draws), max(1, min(n_draws, 4 * n_jobs)))     # contiguous: order kept
    args = [(target, ref, [draws[i] for i in ch], C, S, tpp_C, init, fit_opts) for ch in chunks]
    if n_jobs > 1:
        with ProcessPoolExecutor(max_workers=n_jobs) as pool:
            parts = list(pool.map(_bootstrap_chunk, args))
    else:
        parts = [_bootstrap_chunk(a) for a in args]
    gains = [g for p in parts for g in p[0]]
    tpps = [t for p in parts for t in p[1]]
    failed = sum(p[2] for p in parts)
    if not gains:
        raise ValueError(f"all {n_draws} bootstrap refits failed")
    if failed:
        warnings.warn(f"{failed} of {n_draws} bootstrap draws failed to refit and were dropped", stacklevel=2)
    return Bootstrap(np.array(gains), np.array(tpps), failed)


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
    """Read train.py's results rows (JSON lines), checking the keys this module needs."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            missing = [k for k in REQUIRED_KEYS if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: missing keys {missing}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no results rows")
    return rows


def to_points(rows: Sequence[dict], losses: Sequence[float] | None = None) -> Points:
    """Rows -> Points; `losses` overrides row["val_loss"] (per-subset fits)."""
    L = [r["val_loss"] for r in rows] if losses is None else losses
    cell = np.array([f"{r['scale']}/{r['sparsity_label']}" for r in rows])
    F, S, D, L = _check_points([r["F"] for r in rows], [r["S"] for r in rows], [r["D"] for r in rows], L)
    return Points(F, S, D, L, cell)


def subset_points(rows: Sequence[dict], key: str) -> dict[str, Points]:
    """Per-subset Points from row[key] = {subset: loss} ("val_loss_by_source" / "_by_domain")."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        for name, value in r.get(key, {}).items():
            by[name].append((r, value))
    return {name: to_points([r for r, _ in rv], [v for _, v in rv]) for name, rv in sorted(by.items())}


# ----------------------------------------------------------------------------- tables, plots, CLI
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


def _plot(out: str, data: dict[str, Points], fits: dict[str, Coeffs], cols: dict[str, float],
          Cgrid: np.ndarray, gain: np.ndarray | None, band: tuple | None) -> None:
    """loss_vs_compute.png, reducible_loss.png (SMELT Fig. 9) and, with two surfaces, ce_gain.png."""
    import matplotlib.pyplot as plt
    colours = dict(zip(cols, plt.cm.viridis(np.linspace(0, 0.85, len(cols)))))
    label_of = lambda p: np.array([c.split("/", 1)[1] for c in p.cell])        # sparsity label per point
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (arch, p) in zip(axes[0], data.items()):
        for lab, s in cols.items():
            m = label_of(p) == lab
            ax.scatter(p.F[m] * p.D[m], p.L[m], color=colours[lab], s=14, label=f"S ~ {100 * s:.0f} %")
            ax.plot(Cgrid, frontier_loss(fits[arch], Cgrid, s), color=colours[lab])
        ax.set(xscale="log", xlabel="training compute C = F D (FLOPs)", ylabel="validation loss (nats)",
               title=f"{arch}: points and fitted frontier L*(C, S)")
        ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(os.path.join(out, "loss_vs_compute.png"), dpi=120); plt.close(fig)

    fig, axes = plt.subplots(1, len(cols), figsize=(4.5 * len(cols), 4), squeeze=False)
    for ax, (lab, s) in zip(axes[0], cols.items()):
        for i, (arch, p) in enumerate(data.items()):     # open circles first arch, filled squares next
            m, col = label_of(p) == lab, f"C{i}"
            ax.scatter(p.F[m] * p.D[m], p.L[m] - fits[arch].E, marker="os^v"[i % 4], s=16, label=arch,
                       edgecolors=col, facecolors="none" if i == 0 else col)
            ax.plot(Cgrid, frontier_loss(fits[arch], Cgrid, s) - fits[arch].E, color=col)
        ax.set(xscale="log", yscale="log", xlabel="C (FLOPs)", ylabel="L - E (nats)",
               title=f"S ~ {100 * s:.0f} %: points and frontier L* - E")
        ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(os.path.join(out, "reducible_loss.png"), dpi=120); plt.close(fig)

    if gain is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for j, (lab, s) in enumerate(cols.items()):
            ax.plot(Cgrid, 100 * gain[:, j], color=colours[lab], label=f"S ~ {100 * s:.0f} %")
            if band is not None:
                ax.fill_between(Cgrid, 100 * band[0][:, j], 100 * band[1][:, j], color=colours[lab], alpha=0.2)
        ax.set(xscale="log", xlabel="target compute C (FLOPs)", ylabel="CE gain (%)",
               title="CE gain on the frontier" + (" (95 % cell bootstrap)" if band is not None else ""))
        ax.legend(fontsize=8)
        fig.tight_layout(); fig.savefig(os.path.join(out, "ce_gain.png"), dpi=120); plt.close(fig)


def _subset_report(rows, fits, cols, col_names, C, target, ref) -> tuple[dict, list[str]]:
    """SMELT 5.2 on the rows' per-domain and per-source losses: intercept fits, CE gain at budget C
    for every sparsity column, and the Baseline-loss quartiles (middle sparsity column, as the paper's 95 %)."""
    report, md = {}, []
    for key in ("val_loss_by_domain", "val_loss_by_source"):
        sub = {a: subset_points([r for r in rows if r["arch"] == a], key) for a in (target, ref)}
        if not (sub[target] and sub[ref]):
            continue
        try:
            sf = {a: fit_subsets(sub[a], fits[a]) for a in (target, ref)}
        except ValueError as e:
            warnings.warn(f"per-subset fits on {key} skipped: {e}")
            continue
        g = {lab: subset_ce_gains(sf[target], sf[ref], C, s) for lab, s in cols.items()}   # label -> name -> gain
        names = [k for k in g[next(iter(cols))] if all(k in g[lab] for lab in cols)]
        report[key] = {"fits": {a: {k: asdict(co) for k, co in f.items()} for a, f in sf.items()}, "ce_gain": g}
        md.append(format_table(f"CE gain (%) by {key.removeprefix('val_loss_by_')} at C = {C:.0e}", names,
                               col_names, [[f"{100 * g[lab][k]:.1f}" for lab in cols] for k in names]))
        if key == "val_loss_by_source" and len(names) >= 4:
            mid = len(cols) // 2
            q = quartile_gains(g[list(cols)[mid]], [r[key] for r in rows if r["arch"] == ref and key in r])
            report["quartiles_by_baseline_loss"] = {"sparsity_label": list(cols)[mid], "ce_gain": q.tolist()}
            md.append(format_table(f"CE gain (%) by Baseline-loss quartile ({col_names[mid]})", ["CE gain"],
                                   [f"Q{i + 1}" for i in range(len(q))], [[f"{100 * x:.1f}" for x in q]]))
    return report, md


def analyse(rows: Sequence[dict], out: str, *, n_boot: int = 2000, n_jobs: int = 2, seed: int = 0,
            include_dense: bool = False, budgets: Sequence[float] | None = None,
            target: str = "smelt", ref: str = "baseline") -> dict:
    """Fit every architecture in `rows`, then (with both target and ref) CE gain, TPP, bootstrap
    brackets and per-subset gains; writes coeffs.json, tables.json, tables.md and plots to `out`."""
    if not include_dense:                          # SMELT 4.3: the S = 0 control is a different regime
        rows = [r for r in rows if abs(r["S"]) >= DENSE_S]
        if not rows:
            raise ValueError("no sparse rows (S >= 1 %) to fit; pass --include-dense to fit dense runs")
    os.makedirs(out, exist_ok=True)
    data = {a: to_points([r for r in rows if r["arch"] == a]) for a in sorted({r["arch"] for r in rows})}
    results = {a: fit_result(p.F, p.S, p.D, p.L) for a, p in data.items()}
    fits = {a: r.coeffs for a, r in results.items()}
    by_label: dict[str, list] = defaultdict(list)
    for r in rows:
        by_label[str(r["sparsity_label"])].append(r["S"])
    cols = dict(sorted(((k, float(np.mean(v))) for k, v in by_label.items()), key=lambda kv: kv[1]))
    S_arr = np.array(list(cols.values()))                                             # (nS,)
    C_all = np.concatenate([p.F * p.D for p in data.values()])
    if budgets is None:                            # as the paper: one decade below/at/above the data's top
        k = math.floor(math.log10(C_all.max()))
        budgets = [10.0 ** (k - 1), 10.0 ** k, 10.0 ** (k + 1)]
    budgets = np.array(sorted(budgets), dtype=float)
    tpp_C = float(budgets[len(budgets) // 2])
    Cgrid = np.logspace(math.log10(C_all.min()), math.log10(budgets.max()), 40)
    col_names = [f"S ~ {100 * s:.0f} % ({lab})" for lab, s in cols.items()]
    row_names = [f"C = {C:.0e}" + (" (extrapolated)" if C > C_all.max() else "") for C in budgets]
    report: dict = {"fits": {a: {**asdict(r.coeffs), "rmse_nats": r.rmse, "objective": r.objective,
                                 "converged": r.converged, "n_points": r.n_points, "fixed": r.fixed}
                             for a, r in results.items()},
                    "sparsity": cols, "budgets": budgets.tolist(), "tpp_budget": tpp_C}
    md = ["## Scaling-law fits\n", format_table(
        "Coefficients (Eq. 2)", list(fits), ["E", "A", "K", "a", "b", "c", "RMSE (nats)", "points"],
        [[f"{r.coeffs.E:.4f}", f"{r.coeffs.A:.4g}", f"{r.coeffs.K:.4g}", f"{r.coeffs.a:.4f}", f"{r.coeffs.b:.4f}",
          f"{r.coeffs.c:.4f}", f"{r.rmse:.5f}", str(r.n_points)] for r in results.values()])]
    tpp_pt = {a: [float(tpp(co, tpp_C, s)) for s in S_arr] for a, co in fits.items()}
    report["tpp"] = tpp_pt
    gain_grid = band = tpp_iv = None
    if target in fits and ref in fits:
        gain = ce_gain(fits[target], fits[ref], budgets[:, None], S_arr[None, :])        # (nB, nS)
        gain_grid = ce_gain(fits[target], fits[ref], Cgrid[:, None], S_arr[None, :])     # (nG, nS)
        report["ce_gain"] = gain.tolist()
        cells = [[f"{100 * g:.1f}" for g in row] for row in gain]
        if n_boot > 0:
            bs = cell_bootstrap(data[target], data[ref], np.concatenate([budgets, Cgrid]), S_arr, tpp_C=tpp_C,
                                n_draws=n_boot, seed=seed, n_jobs=n_jobs, init=(fits[target], fits[ref]))
            lo, hi = Bootstrap.interval(bs.gain)                                        # (nB + nG, nS)
            band = (lo[len(budgets):], hi[len(budgets):])
            tpp_iv = Bootstrap.interval(bs.tpp)                                         # (2, nS) each
            report["bootstrap"] = {"n_draws": n_boot, "n_failed": bs.n_failed,
                                   "ce_gain_lo": lo[:len(budgets)].tolist(),
                                   "ce_gain_hi": hi[:len(budgets)].tolist(),
                                   "tpp_lo": dict(zip((target, ref), tpp_iv[0].tolist())),
                                   "tpp_hi": dict(zip((target, ref), tpp_iv[1].tolist()))}
            cells = [[f"{c} [{100 * l:.0f}, {100 * h:.0f}]" for c, l, h in zip(row, lr, hr)]
                     for row, lr, hr in zip(cells, lo, hi)]
        md.append(format_table(f"CE gain of {target} over {ref} (%)", row_names, col_names, cells))
        report["subsets"], subset_md = _subset_report(rows, fits, cols, col_names, tpp_C, target, ref)
        md += subset_md
    tp_rows = []
    for a in fits:
        i = {target: 0, ref: 1}.get(a) if tpp_iv is not None else None      # tpp_iv rows: [target, ref]
        tp_rows.append([f"{v:.0f}" + ("" if i is None else f" [{tpp_iv[0][i][j]:.0f}, {tpp_iv[1][i][j]:.0f}]")
                        for j, v in enumerate(tpp_pt[a])])
    md.append(format_table(f"Compute-optimal tokens per parameter, TPP at C = {tpp_C:.0e}", list(fits),
                           col_names, tp_rows))
    _plot(out, data, fits, cols, Cgrid, gain_grid, band)
    with open(os.path.join(out, "coeffs.json"), "w") as f:
        json.dump(report["fits"], f, indent=2)
    with open(os.path.join(out, "tables.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write("\n".join(md))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Fit SMELT Eq. 2 loss surfaces per architecture and report "
                                 "CE gain, TPP, cell-bootstrap brackets, per-subset gains and plots.")
    ap.add_argument("--results", help="results.jsonl written by train.py (one JSON row per finished run)")
    ap.add_argument("--out", default="scaling_out", help="output directory for JSON, tables and plots")
    ap.add_argument("--bootstrap", type=int, default=2000, help="cell-bootstrap draws (0 to skip)")
    ap.add_argument("--n-jobs", type=int, default=2, help="worker processes for the bootstrap")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument("--budgets", type=float, nargs="+", help="compute budgets (FLOPs) for the CE-gain table; "
                    "default: a decade below, at and above the data's largest compute; TPP uses the middle one")
    ap.add_argument("--include-dense", action="store_true", help="also fit S ~ 0 cells (the paper excludes them)")
    ap.add_argument("--paper", action="store_true", help="print SMELT's CE-gain and TPP tables from Table 4.3")
    args = ap.parse_args(argv)
    if args.paper:
        print(paper_tables())
        return
    if not args.results:
        ap.error("give --results FILE or --paper")
    analyse(read_results(args.results), args.out, n_boot=args.bootstrap, n_jobs=args.n_jobs, seed=args.seed,
            include_dense=args.include_dense, budgets=args.budgets)
    print(open(os.path.join(args.out, "tables.md")).read())


if __name__ == "__main__":
    main()
