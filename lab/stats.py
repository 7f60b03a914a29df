"""Numbers a reader can trust: intervals, paired differences, permutation tests, three-state verdicts.

Every comparison this project reports goes through here: an `Interval` (Student t: with 3 seeds a normal
interval would be 2.2x too narrow; or a percentile bootstrap over units), and a `verdict` that is "reproduced"
only when the whole interval lies on the claimed side, "contradicted" when it lies on the other, else "not
resolved" (a point estimate's sign never decides).  `permutation_test`: SMELT Appendix C's sign-flip test.
Hand-computed cases: tests/test_stats.py.  Read next: scaling.py.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

VERDICTS = ("reproduced", "contradicted", "not resolved")
MIN_BOOTSTRAP_UNITS = 10   # a 95 % percentile bootstrap of a mean covered 52 / 71 / 84 / 90 % at 2 / 3 / 5 / 10 units


@dataclass(frozen=True)
class Interval:
    """A point estimate `mean` with a `level` two-sided interval [lo, hi] over `n` units."""
    mean: float
    lo: float
    hi: float
    n: int
    level: float = 0.95
    method: str = "t"

    @property
    def resolved(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    @property
    def few_units(self) -> bool:
        """A percentile bootstrap over fewer than MIN_BOOTSTRAP_UNITS units: kept, but too narrow to decide."""
        return "bootstrap" in self.method and self.n < MIN_BOOTSTRAP_UNITS

    def to_dict(self) -> dict:
        return asdict(self)

    def fmt(self, nd: int = 3) -> str:
        """'+0.012 [-0.004, +0.028]' (or '+0.012 (no interval: n = 1)')."""
        m = f"{self.mean:+.{nd}f}"
        if not self.resolved:
            return f"{m} (no interval: n = {self.n})"
        few = f" (bootstrap over {self.n} units: too few to decide)" if self.few_units else ""
        return f"{m} [{self.lo:+.{nd}f}, {self.hi:+.{nd}f}]{few}"


def _vector(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} holds non-finite values: {a[~np.isfinite(a)][:4].tolist()}")
    return a


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")


def t_quantile(p: float, dof: int) -> float:
    from scipy.stats import t
    return float(t.ppf(p, dof))


def mean_interval(x: Sequence[float], level: float = 0.95) -> Interval:
    """Student-t interval of the mean of x; none (bounds nan) from one value or values without spread."""
    _check_level(level)
    a = _vector(x, "x")
    n, m = a.size, float(a.mean())
    if n < 2 or float(a.std(ddof=1)) == 0.0:
        return Interval(m, math.nan, math.nan, n, level, "t")
    half = t_quantile(0.5 + level / 2, n - 1) * float(a.std(ddof=1)) / math.sqrt(n)
    return Interval(m, m - half, m + half, n, level, "t")


def slope_interval(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> Interval:
    """OLS slope of y on x with its t-interval (n - 2 degrees of freedom); none (bounds nan) from 2 points."""
    _check_level(level)
    vx, vy = _vector(x, "x"), _vector(y, "y")
    if vx.shape != vy.shape or vx.size < 2 or np.ptp(vx) == 0:
        raise ValueError(f"slope_interval: needs x and y of equal length >= 2 with x spread, got {vx.size}, {vy.size}")
    xc = vx - vx.mean()
    slope = float(xc @ (vy - vy.mean()) / (xc @ xc))
    if vx.size < 3:
        return Interval(slope, math.nan, math.nan, vx.size, level, "ols")
    resid = vy - vy.mean() - slope * xc
    half = t_quantile(0.5 + level / 2, vx.size - 2) * math.sqrt(float(resid @ resid) / (vx.size - 2) / float(xc @ xc))
    return Interval(slope, slope - half, slope + half, vx.size, level, "ols")


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """Interval of mean(b - a) over paired units (a[i] and b[i] share seed / batch / item)."""
    va, vb = _vector(a, "a"), _vector(b, "b")
    if va.shape != vb.shape:
        raise ValueError(f"paired_difference: a and b must pair up, got {va.size} and {vb.size} values")
    return mean_interval(vb - va, level)


def welch_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """Welch's t-interval of mean(b) - mean(a); none (bounds nan) unless both have 2 values and some spread."""
    _check_level(level)
    va, vb = _vector(a, "a"), _vector(b, "b")
    d, n = float(vb.mean() - va.mean()), va.size + vb.size
    qa, qb = (va.var(ddof=1) / va.size, vb.var(ddof=1) / vb.size) if va.size > 1 and vb.size > 1 else (0, 0)
    if qa + qb == 0:
        return Interval(d, math.nan, math.nan, n, level, "welch")
    dof = (qa + qb) ** 2 / (qa ** 2 / (va.size - 1) + qb ** 2 / (vb.size - 1))
    half = t_quantile(0.5 + level / 2, dof) * math.sqrt(qa + qb)
    return Interval(d, d - half, d + half, n, level, "welch")


def bootstrap_interval(x: Sequence[float], stat: Callable[[np.ndarray], float] = np.mean, n_draws: int = 2000,
                       level: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap of stat(x) over units resampled with replacement (x: one value per unit)."""
    _check_level(level)
    a = _vector(x, "x")
    if isinstance(n_draws, bool) or not isinstance(n_draws, (int, np.integer)) or n_draws < 1:
        raise ValueError(f"n_draws must be an integer >= 1, got {n_draws!r}")
    point = float(stat(a))
    if a.size < 2:
        return Interval(point, math.nan, math.nan, a.size, level, "bootstrap")
    rng = np.random.default_rng(seed)
    draws = np.array([stat(a[rng.integers(0, a.size, a.size)]) for _ in range(n_draws)], dtype=float)
    lo, hi = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return Interval(point, float(lo), float(hi), a.size, level, "bootstrap")


def percentiles_with_failures(ok: np.ndarray, n_failed: int, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """The level interval's percentiles along axis 0 over the draws `ok` and n_failed failed ones, counted as
    -inf for the lower bound and +inf for the upper (not conditional on success)."""
    _check_level(level)
    ok = np.asarray(ok, dtype=float)
    if n_failed < 0 or (len(ok) == 0 and n_failed == 0):
        raise ValueError(f"need at least one draw and n_failed >= 0; got {len(ok)} draws, n_failed = {n_failed}")
    q = 50 * (1 - level)
    if n_failed == 0:
        return np.percentile(ok, q, axis=0), np.percentile(ok, 100 - q, axis=0)

    def lower(s: np.ndarray) -> np.ndarray:          # s sorted ascending along axis 0, n_failed -inf in front
        h = (len(s) + n_failed - 1) * q / 100
        i, t = int(math.floor(h)), h - math.floor(h)
        if i < n_failed:
            return np.full(s.shape[1:], -math.inf)
        a, b = s[i - n_failed], s[min(i - n_failed + 1, len(s) - 1)]
        return a + t * (b - a)
    s = np.sort(ok, axis=0)
    return lower(s), -lower(np.sort(-ok, axis=0))


def verdict(iv: Interval | None, claim: str, value: float = 0.0) -> str:
    """The verdict on "quantity `claim` value" (claim '>' or '<'); not resolved from too few bootstrap units."""
    if claim not in (">", "<"):
        raise ValueError(f"claim must be '>' or '<', got {claim!r}")
    if iv is None or not iv.resolved or iv.few_units:
        return "not resolved"
    above, below = iv.lo > value, iv.hi < value
    yes, no = (above, below) if claim == ">" else (below, above)
    return "reproduced" if yes else "contradicted" if no else "not resolved"


def all_of(verdicts: Sequence[str]) -> str:
    """Reproduced when every part is, contradicted when one is, else (or with no parts) not resolved."""
    v = list(verdicts)
    return ("reproduced" if v and all(x == "reproduced" for x in v) else
            "contradicted" if "contradicted" in v else "not resolved")


def permutation_test(a: Sequence[float], b: Sequence[float], n: int = 10000, seed: int = 0,
                     alternative: str = "two-sided") -> float:
    """Paired sign-flip test of mean(a - b) = 0 ("greater": a > b): exact for up to 16 pairs, else
    p = (1 + hits) / (n + 1) over `n` random sign patterns."""
    d = _vector(np.asarray(a, dtype=float) - np.asarray(b, dtype=float), "permutation_test's a - b")
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be 'two-sided', 'greater' or 'less', got {alternative!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (random sign patterns) must be an integer >= 1, got {n!r}")
    stat = {"two-sided": lambda m: np.abs(m), "greater": lambda m: m, "less": lambda m: -m}[alternative]
    obs = stat(d.mean())
    if len(d) <= 16:
        signs = np.array(list(itertools.product((1, -1), repeat=len(d))), dtype=float)
        return float((stat((signs * d).mean(1)) >= obs - 1e-12).mean())
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    while done < n:
        m = min(n - done, max(1, (1 << 22) // len(d)))
        signs = rng.integers(0, 2, size=(m, len(d))) * 2 - 1
        hits += int((stat((signs * d).mean(1)) >= obs - 1e-12).sum())
        done += m
    return (1 + hits) / (n + 1)
