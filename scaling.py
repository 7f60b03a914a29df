"""Scaling laws (SMELT Section 4): Eq. 2's loss surface, its robust fit, the compute-optimal frontier.

`loss` is Eq. 2, L(F, S, D) = E + A (1 - S)^b / F^a + K / D^c (F FLOPs/token, S the compute-equivalent
sparsity of budget.py's Eq. 1, D tokens); `fit_result` fits it as the paper does (4.3: Huber on log-loss
residuals, L-BFGS-B from a grid of starts) and `identify` says whether the fit means anything.  Eqs. 3-5:
`optimal_flops_per_token`, `frontier_loss`, `ce_gain`, `tpp`; `law_gap` and `data_crossover`: what two surfaces
say of a matched pair (SMELT 4.3's data-term crossover).  Results rows -> `Points`: `seed_means`,
`split_control` (the S = 0 controls left out), `to_points`.

Read first: budget.py.  Read next: lab/scaling_analysis.py, lab/scaling_report.py; the rules: docs/scaling.md.
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import minimize


try:  # scipy's L-BFGS-B calls BLAS on 6-vectors: one BLAS thread is much faster there (docs/scaling.md)
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: correct without it, only slower on loaded machines
    threadpool_limits = None


@dataclass
class Coeffs:
    """Six coefficients of SMELT Eq. 2 (loss in nats, F in FLOPs/token, D in tokens)."""
    E: float; A: float; K: float; a: float; b: float; c: float

    @property
    def gamma(self) -> float:
        """Eq. 4's frontier exponent: L* - E falls as C^-gamma."""
        return self.a * self.c / (self.a + self.c)


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
    """Identification thresholds; docs/scaling.md gives the reason for each."""
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


def loss(co: Coeffs, F, S, D) -> np.ndarray:
    """SMELT Eq. 2, vectorised over broadcastable F (FLOPs/token), S (fraction < 1), D (tokens)."""
    F, S, D = (np.asarray(x, dtype=float) for x in (F, S, D))
    return co.E + co.A * (1.0 - S) ** co.b / F ** co.a + co.K / D ** co.c


def law_gap(target: Coeffs, ref: Coeffs, F_t, S_t, F_r, S_r, D) -> np.ndarray:
    """L_target - L_ref by Eq. 2 at each model's own F and S and the same tokens D (a matched pair's gap)."""
    return loss(target, F_t, S_t, D) - loss(ref, F_r, S_r, D)


def data_crossover(target: Coeffs, ref: Coeffs) -> float:
    """D* where the data terms K / D^c are equal, (K_t / K_r)^(1 / (c_t - c_r)); below it the target's is higher
    when K_t > K_r and c_t > c_r (SMELT 4.3: ~1.6e10 tokens for Table 4.3); nan when c_t = c_r."""
    dc = target.c - ref.c
    return math.exp(math.log(target.K / ref.K) / dc) if dc else math.nan


PAPER_CROSSOVER_D = data_crossover(PAPER_SMELT, PAPER_BASELINE)   # 1.62e10 tokens ("D ~ 1.6 x 10^10", Sec. 4.3)


def check_points(F, S, D, L) -> tuple[np.ndarray, ...]:
    """Validate fit inputs: non-empty, equal-length, finite, F, D, L > 0, 0 <= S < 1.  Float arrays."""
    arrs = []
    for name, x in zip("FSDL", (F, S, D, L)):
        try:
            x = np.asarray(x, dtype=float).ravel()
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} must be a sequence of numbers ({e})") from None
        arrs.append(x)
        if x.size == 0:
            raise ValueError(f"{name} is empty: a fit needs points")
        if len(x) != len(arrs[0]):
            raise ValueError(f"F, S, D, L must have equal lengths; {name} has {len(x)}, F has {len(arrs[0])}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} contains NaN or inf at index {int(np.flatnonzero(~np.isfinite(x))[0])}")
        if name != "S" and np.any(x <= 0):
            raise ValueError(f"{name} must be positive; got {x.min()} at index {int(np.argmin(x))}")
    S = arrs[1]
    if np.any(S < -S_ROUNDING):
        raise ValueError(f"S must be >= 0 (compute-equivalent sparsity, a fraction); got {S.min()} "
                         f"at index {int(np.argmin(S))}")
    if np.any(S >= 1):
        raise ValueError(f"S must be < 1 (a fraction, not a percentage); got max {S.max()}")
    arrs[1] = np.maximum(S, 0.0)
    return tuple(arrs)


@dataclass
class FitResult:
    coeffs: Coeffs
    rmse: float            # nats, on L itself (not log L), as the paper's Table 4.3 reports
    objective: float       # sum of Huber(delta) over log-loss residuals (Epoch's convention)
    converged: bool
    n_points: int          # distinct (F, S, D) points: the identification rules count these
    fixed: dict = field(default_factory=dict)
    se: dict = field(default_factory=dict)       # standard errors of the free exponents (inf: unresolved)
    ranges: dict = field(default_factory=dict)   # data spans {"F", "D", "C", "one_minus_S"}: (lo, hi)
    why: list = field(default_factory=list)      # reasons the fit is not identified; [] = identified

    @property
    def identified(self) -> bool:
        return not self.why


def data_ranges(F, S, D) -> dict:
    C = F * D
    return {k: (float(v.min()), float(v.max())) for k, v in (("F", F), ("D", D), ("C", C), ("one_minus_S", 1 - S))}


def short_num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def data_checks(n_points: int, n_free: int, spans: Mapping[str, float], b_free: bool,
                rules: Rules = RULES) -> list[str]:
    """`identify`'s checks of the data alone (points per free coefficient, spans hi / lo); a plan's grid's too."""
    why = []
    if n_points < rules.min_points_per_coef * n_free:
        why.append(f"too few points: {n_points} distinct for {n_free} coefficients "
                   f"(< {rules.min_points_per_coef:g} per coefficient)")
    rule = [("C", "compute range: compute", rules.min_C_ratio), ("F", "F range: F", rules.min_F_ratio),
            ("D", "D range: D", rules.min_D_ratio)]
    if b_free:
        rule.append(("one_minus_S", "sparsity range: b is free but 1 - S", rules.min_one_minus_S_ratio))
    for k, what, lim in rule:
        if k in spans and spans[k] < lim:
            why.append(f"{what} spans only {short_num(spans[k])}x (< {lim:g}x)")
    return why


def identify(res: FitResult, rules: Rules = RULES) -> list[str]:
    """Reasons (one "key: detail" string per failed check of `Rules`) why `res` is not identified; [] if it is."""
    co, rg, fixed = res.coeffs, res.ranges, res.fixed
    n_free = 6 - len(fixed)
    known = {"C", "F", "D", "one_minus_S"} <= set(rg)
    spans = {k: hi / lo for k, (lo, hi) in rg.items()} if known else {}
    why = data_checks(res.n_points, n_free, spans, "b" not in fixed, rules)
    if not known:
        return why + ["data ranges: unknown (a FitResult from fit_result carries them)"]
    if not res.converged:
        why.append("not converged: L-BFGS-B stopped away from a stationary point")
    free_ac = [k for k in ("a", "c") if k not in fixed]
    for k in free_ac:                                        # rule names and thresholds only: the estimates
        v = getattr(co, k)                                   # of a fit that is not identified are not printed
        if v <= 0:
            why.append(f"exponent sign: {k} is not > 0")
        elif v < rules.exp_min:
            why.append(f"exponent bound: {k} within {rules.exp_min:g} of its bound 0")
        elif v > rules.exp_max:
            why.append(f"exponent bound: {k} > {rules.exp_max:g}")
    if "b" not in fixed:
        if co.b < rules.b_min:
            why.append("exponent sign: b < 0 (sparser cells fit worse at equal F, against SMELT's b > 0)")
        elif co.b > rules.b_max:
            why.append(f"exponent bound: b > {rules.b_max:g}")
    if co.a > 0 and co.c > 0:
        lo, hi = rules.c_over_a
        if not lo <= co.c / co.a <= hi:
            why.append(f"exponent ratio: c / a outside [{lo:g}, {hi:g}] (so the F* exponent c / (a + c) is outside "
                       f"[{lo / (1 + lo):.2g}, {hi / (1 + hi):.2g}])")
    for k in free_ac:
        v, se = getattr(co, k), res.se.get(k, 0.0)
        if v > 0 and math.isinf(se):
            why.append(f"design singular: the data cannot separate {k} from the other coefficients "
                       f"(no finite standard error)")
        elif v > 0 and not v >= rules.min_t * se:
            why.append(f"exponent uncertain: {k} < {rules.min_t:g} standard errors from 0")
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
        m = z.max(axis=1, keepdims=True)                     # plain numpy LSE: scipy's is far slower on (N, 3)
        ez = np.exp(z - m)
        w = ez / ez.sum(axis=1, keepdims=True)               # (N, 3) softmax weights = d LSE / d z
        jac = np.stack([w[:, 0], w[:, 1], w[:, 2], -w[:, 1] * self.x, w[:, 1] * self.s, -w[:, 2] * self.y], axis=1)
        return m[:, 0] + np.log(ez.sum(axis=1)), jac


def _gauss_newton_se(J_NP: np.ndarray, r_N: np.ndarray, max_cond: float, n_distinct: int | None = None) -> np.ndarray:
    """sqrt(diag(s^2 (J^T J)^-1)), s^2 = RSS / (n - P) over n distinct points; inf when n <= P or ill-conditioned."""
    N, p = J_NP.shape
    n = N if n_distinct is None else n_distinct
    norms = np.linalg.norm(J_NP, axis=0)
    if n <= p or np.any(norms == 0):
        return np.full(p, np.inf)
    Js = J_NP / norms
    M = Js.T @ Js                                     # one array: numpy's syrk, bit-stable
    if not np.isfinite(M).all() or np.linalg.cond(M) > max_cond:
        return np.full(p, np.inf)
    s2 = float(r_N @ r_N) / (n - p)
    return np.sqrt(np.maximum(np.diag(np.linalg.inv(M)), 0.0) * s2) / norms


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    return np.where(np.abs(r) <= delta, 0.5 * r ** 2, delta * (np.abs(r) - 0.5 * delta))


def huber_objective(co: Coeffs, F, S, D, L, delta: float = 1e-3) -> float:
    """The fit objective: sum_i Huber_delta(log L_hat_i - log L_i)."""
    F, S, D, L = check_points(F, S, D, L)
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
    """Fit Eq. 2 (`fixed` pins coefficients, `init` adds starts); the result says why it is not identified."""
    F, S, D, L = check_points(F, S, D, L)
    fixed = dict(fixed or {})
    if not set(fixed) <= {"E", *EXPONENTS}:
        raise ValueError(f"`fixed` may pin E, a, b, c only; got {sorted(fixed)}")
    bad = {k: v for k, v in fixed.items() if not (0 < v < math.inf if k == "E" else BOUNDS[k][0] <= v <= BOUNDS[k][1])}
    if bad:
        raise ValueError(f"`fixed` values out of their domain (E finite > 0, exponents within {BOUNDS}): {bad}")
    if "b" not in fixed and np.ptp(np.log1p(-S)) == 0:
        warnings.warn("all points share one sparsity S: b is unidentifiable, fixing b = 0", stacklevel=2)
        fixed["b"] = 0.0
    if len(L) < 6 - len(fixed):
        raise ValueError(f"{len(L)} points cannot determine {6 - len(fixed)} free coefficients")
    for name, x, k in (("F", F, "a"), ("D", D, "c")):
        if np.ptp(x) == 0 and k not in fixed:
            raise ValueError(f"all points share one {name}: its exponent is unidentifiable")
    n_distinct = len(np.unique(np.stack([F, S, D], axis=1), axis=0))    # exact repeats (a cell drawn twice) count once
    des = _Design(F, S, D, L)
    names = ["E", "alpha", "kappa", "a", "b", "c"]                    # the centred vector holds e = log E
    free = np.array([n not in fixed for n in names])
    pinned = np.array([math.log(fixed.get("E", 1.0)), 0.0, 0.0, *(fixed.get(n, 0.0) for n in EXPONENTS)])

    def f_and_g(u: np.ndarray, th0: np.ndarray) -> tuple[float, np.ndarray]:
        th = th0.copy(); th[free] = u
        logLhat, jac = des.log_model(th)
        r = logLhat - des.logL                                        # (N,) log-loss residuals
        return float(_huber(r, delta).sum() / delta ** 2), jac[:, free].T @ (np.clip(r, -delta, delta) / delta ** 2)

    bounds = [bd for bd, f in zip([(None, None)] * 3 + [BOUNDS[n] for n in EXPONENTS], free) if f]
    starts = [np.where(free, th, pinned) for th in _starts(des, L, "b" not in fixed)]
    if n_starts is not None:                          # score every grid start cheaply, keep the best
        scores = [f_and_g(th[free], th)[0] for th in starts]
        starts = [starts[i] for i in np.argsort(scores)[:n_starts]]
    starts = [np.where(free, des.to_theta(co), pinned) for co in init] + starts
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
        se_free = _gauss_newton_se(jac[:, free], logLhat - des.logL, rules.max_cond, n_distinct)
    # not converged: stopped by the iteration limit (status 1) with a projected gradient that is not small
    g = np.asarray(res.jac, dtype=float).copy()
    lo, hi = np.array([(-np.inf, np.inf) if bd[0] is None else bd for bd in bounds], dtype=float).T
    g[((res.x <= lo) & (g > 0)) | ((res.x >= hi) & (g < 0))] = 0.0        # pressing on a bound is fine
    # a stalled line search (status 2) is a minimum here: the Huber kinks at |r| = delta (docs/scaling.md)
    converged = bool(res.success or res.status == 2 or np.abs(g).max() <= 1e-5 * max(1.0, abs(res.fun)))
    if not converged:
        warnings.warn(f"L-BFGS-B did not converge: {res.message}", stacklevel=2)
    se = {n: float(s) for n, s in zip([n for n, f in zip(names, free) if f], se_free) if n in EXPONENTS}
    rmse = float(np.sqrt(np.mean((loss(co, F, S, D) - L) ** 2)))
    out = FitResult(co, rmse, huber_objective(co, F, S, D, L, delta), converged, n_distinct, fixed, se,
                    data_ranges(F, S, D))
    out.why = identify(out, rules)
    return out


def fit(F, S, D, L, **opts) -> Coeffs:
    return fit_result(F, S, D, L, **opts).coeffs


def check_budget(C, S, co: Coeffs | None = None) -> tuple[np.ndarray, np.ndarray]:
    if co is not None and min(co.A, co.K, co.a, co.c) <= 0:
        raise ValueError(f"a compute-optimal frontier needs A, K, a and c > 0; got {co}")
    C, S = np.asarray(C, dtype=float), np.asarray(S, dtype=float)
    if np.any(~np.isfinite(C)) or np.any(C <= 0):
        raise ValueError(f"compute C must be positive and finite; got {C}")
    if np.any(~np.isfinite(S)) or np.any(S >= 1):
        raise ValueError(f"sparsity S must be a finite fraction < 1; got {S}")
    return C, S


def optimal_flops_per_token(co: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 3: F* = (a A (1-S)^b C^c / (c K))^(1/(a+c)) minimises Eq. 2 subject to F * D = C."""
    C, S = check_budget(C, S, co)
    logF = (math.log(co.a * co.A / (co.c * co.K)) + co.b * np.log1p(-S) + co.c * np.log(C)) / (co.a + co.c)
    return np.exp(logF)[()]


def frontier_loss(co: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 4: L*(C, S) = E + (1 + a/c) A (1-S)^b F*^-a (at F* the data term is a/c times the capacity term)."""
    F = optimal_flops_per_token(co, C, S)
    return (co.E + (1 + co.a / co.c) * co.A * (1 - np.asarray(S, dtype=float)) ** co.b / F ** co.a)[()]


def compute_for_loss(co: Coeffs, L, S) -> float | np.ndarray:
    """Inverse of Eq. 4: the budget C at which the frontier reaches loss L (inf if L <= E)."""
    prefactor = frontier_loss(co, 1.0, S) - co.E                      # L* - E at C = 1
    with np.errstate(divide="ignore", invalid="ignore"):
        C = np.where(np.asarray(L) > co.E, (prefactor / (np.asarray(L) - co.E)) ** (1 / co.gamma), np.inf)
    return C[()]


def ce_gain(target: Coeffs, ref: Coeffs, C, S) -> float | np.ndarray:
    """Eq. 5: 1 - C / C_ref, C_ref where the reference frontier reaches the target's loss at C (1 below its E)."""
    C_ref = compute_for_loss(ref, frontier_loss(target, C, S), S)
    if np.any(np.isinf(C_ref)):
        warnings.warn("target frontier is below the reference floor E: CE gain -> 1", stacklevel=2)
    return (1.0 - np.asarray(C) / C_ref)[()]


def tpp(co: Coeffs, C, S) -> float | np.ndarray:
    """Compute-optimal tokens per dense-equivalent parameter, D* / (F*/6) = 6 C / F*^2."""
    F = optimal_flops_per_token(co, C, S)
    return (6.0 * np.asarray(C, dtype=float) / F ** 2)[()]


@dataclass
class Points:
    """One architecture's fit data: (N,) arrays and the grid cell each point belongs to."""
    F: np.ndarray; S: np.ndarray; D: np.ndarray; L: np.ndarray
    cell: np.ndarray                                   # (N,) cell ids, e.g. "t96/S~55%"

    def take(self, idx: np.ndarray) -> "Points":
        return Points(self.F[idx], self.S[idx], self.D[idx], self.L[idx], self.cell[idx])


def paper_shaped_points(co: Coeffs, F_span: float, D_span: float, noise: float, seed: int = 0,
                        n_scales: int = 4, sparsities: Sequence[float] = PAPER_SPARSITIES,
                        n_horizons: int = 6, horizons: Sequence[float] | None = None) -> Points:
    """SMELT's grid (scales x sparsities x horizons, F from 6.6e8, D up to 3.2e11) drawn from `co` with noise."""
    rng = np.random.default_rng(seed)
    fr = D_span ** np.linspace(-1, 0, n_horizons) if horizons is None else np.asarray(horizons, float)
    Fs = 6.6e8 * F_span ** np.linspace(0, 1, n_scales)
    pts = [(F, s, 3.2e11 * f, f"{F:.3g}/{s}") for F in Fs for s in sparsities for f in fr]
    F, S, D = (np.array([p[i] for p in pts]) for i in range(3))
    L = loss(co, F, S, D) * np.exp(noise * rng.standard_normal(len(F)))
    return Points(F, S, D, L, np.array([p[3] for p in pts]))


def paper_pair(F_span: float, D_span: float, noise: float, seed: int = 0, grid: dict | None = None) -> dict:
    """{"smelt", "baseline": Points} from Table 4.3's surfaces on one paper-shaped grid, each its own noise seed."""
    return {name: paper_shaped_points(co, F_span, D_span, noise, seed=seed + 1000 * k, **(grid or {}))
            for k, (name, co) in enumerate((("smelt", PAPER_SMELT), ("baseline", PAPER_BASELINE)))}


def calibrate_rules(F_spans=(1.5, 2, 3, 5, 16), D_spans=(1.5, 2, 4, 10), noises=(0.003, 0.01, 0.03),
                    seeds: int = 5, rules: Rules = RULES, n_starts: int = 8, grid: dict | None = None) -> list[dict]:
    """The measurement behind `Rules`: per setting, are `paper_pair`'s two fits identified, and how far off are
    their exponents and the CE gain at S = 0.95 at the data's midpoint budget?"""
    out, truths = [], (("smelt", PAPER_SMELT), ("baseline", PAPER_BASELINE))
    for Fs, Ds, noise, seed in product(F_spans, D_spans, noises, range(seeds)):
        with warnings.catch_warnings(action="ignore"):
            res = {name: fit_result(p.F, p.S, p.D, p.L, n_starts=n_starts, rules=rules)
                   for name, p in paper_pair(Fs, Ds, noise, seed, grid).items()}
            C = math.sqrt(res["baseline"].ranges["C"][0] * res["baseline"].ranges["C"][1])
            try:
                g = float(ce_gain(res["smelt"].coeffs, res["baseline"].coeffs, C, 0.95))
            except ValueError:                                  # an exponent at 0: no frontier at all
                g = math.nan
        truth = float(ce_gain(PAPER_SMELT, PAPER_BASELINE, C, 0.95))
        out.append({"F_span": Fs, "D_span": Ds, "noise": noise, "seed": seed,
                    "identified": all(r.identified for r in res.values()),
                    "why": sorted({w.split(":")[0] for r in res.values() for w in r.why}),
                    **{f"{k}_err": max(abs(getattr(res[n].coeffs, k) - getattr(co, k)) for n, co in truths)
                       for k in "ac"},
                    "gain": g, "gain_true": truth, "gain_err_pp": 100 * abs(g - truth)})
    return out


REQUIRED_KEYS = ("arch", "scale", "sparsity_label", "F", "S", "D", "val_loss")


def read_results(path: str) -> list[dict]:
    """train.py's results rows (checks.read_jsonl); a bad line is a ValueError naming it."""
    import checks   # run files bring torch: the fits themselves need neither
    try:
        return checks.read_jsonl(path, REQUIRED_KEYS)
    except checks.CheckpointError as e:
        raise ValueError(str(e)) from None


def check_rows(rows: Sequence[dict]) -> None:
    """Every row a dict with REQUIRED_KEYS, F, D, val_loss > 0, S in [0, 1) (control cells: [-0.5, 1))."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError("rows must be a non-empty list of results rows (dicts)")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"rows[{i}] is not a dict: {type(r).__name__}")
        if missing := [k for k in REQUIRED_KEYS if k not in r]:
            raise ValueError(f"rows[{i}] misses keys {missing}")
        where = f"rows[{i}] ({r['arch']} {r['scale']} {r['sparsity_label']})"
        for k in ("F", "S", "D", "val_loss"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {k} = {v!r} is not a finite number")
            if k != "S" and v <= 0:
                raise ValueError(f"{where}: {k} = {v!r} must be > 0")
        # a control cell's looped model may measure S slightly below 0 (matching moves its FLOPs by up to
        # 4 %); control rows are fitted only with include_dense, at S clipped to 0 (split_control)
        lo = -0.5 if r["sparsity_label"] == CONTROL_LABEL else -S_ROUNDING
        if not lo <= r["S"] < 1:
            raise ValueError(f"{where}: S = {r['S']!r} must lie in [{0 if lo > -0.5 else lo}, 1) (a fraction)")


def cell_id(row: dict) -> str:
    return f"{row['scale']}/{row['sparsity_label']}"


def to_points(rows: Sequence[dict], losses: Sequence[float] | None = None) -> Points:
    """Rows -> Points; `losses` overrides row["val_loss"] (per-subset fits)."""
    L = [r["val_loss"] for r in rows] if losses is None else losses
    return Points(*check_points(*([r[k] for r in rows] for k in "FSD"), L), np.array([cell_id(r) for r in rows]))


def subset_points(rows: Sequence[dict], key: str) -> dict[str, Points]:
    """Per-subset Points from row[key] = {subset: loss} ("val_loss_by_source" / "_by_domain")."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        for name, value in (r.get(key) or {}).items():
            by[name].append((r, value))
    return {name: to_points([r for r, _ in rv], [v for _, v in rv]) for name, rv in sorted(by.items())}


def seed_means(rows: Sequence[dict]) -> list[dict]:
    """One row per (arch, cell, D): replicates' val_loss and "val_loss_by_*" averaged, "n_seeds" / "seeds" added."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["arch"], cell_id(r), float(r["D"]))].append(r)
    out = []
    for (arch, cell, D), rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        for k in ("F", "S"):
            v = [float(r[k]) for r in rs]
            if max(v) - min(v) > 1e-6 * max(1.0, abs(max(v))):
                raise ValueError(f"{arch} {cell} at D = {D:g}: {len(rs)} rows differ in {k} ({min(v):g} .. "
                                 f"{max(v):g}), so they are not replicates of one model")
        m = {**rs[0], "val_loss": float(np.mean([r["val_loss"] for r in rs])), "n_seeds": len(rs),
             "seeds": [r.get("seed") for r in rs]}
        for k in sorted({k for r in rs for k in r if k.startswith("val_loss_by_")}):
            names = [sorted((r.get(k) or {}).keys()) for r in rs]
            if any(n != names[0] for n in names):     # a mean over fewer seeds than val_loss's would mix the two
                raise ValueError(f"{arch} {cell} at D = {D:g}: its {len(rs)} replicates report different {k} "
                                 f"subsets, so their means would rest on different seeds")
            m[k] = {n: float(np.mean([r[k][n] for r in rs])) for n in names[0]}
        out.append(m)
    return out


def split_control(rows: Sequence[dict], include_dense: bool = False) -> tuple[list[dict], list[dict]]:
    """(rows to fit, control rows left out): the control is every CONTROL_LABEL row, whatever S it measures
    (SMELT 4.3), a looped control's S below 0 clipped to 0.  include_dense keeps the control in the fit."""
    clipped = [{**r, "S": max(float(r["S"]), 0.0)} if r["sparsity_label"] == CONTROL_LABEL else r for r in rows]
    if include_dense:
        return clipped, []
    control = [r for r in clipped if r["sparsity_label"] == CONTROL_LABEL]
    return [r for r in rows if r["sparsity_label"] != CONTROL_LABEL], control
