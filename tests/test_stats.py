"""stats.py against hand-computed cases."""
import itertools
import math

import numpy as np
import pytest

from lab import stats


def test_mean_interval_hand_computed():
    # x = 1, 2, 3: mean 2, sd 1, se 1/sqrt(3); t_{0.975, 2} = 4.302653
    iv = stats.mean_interval([1.0, 2.0, 3.0])
    half = 4.302653 / math.sqrt(3)
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.lo == pytest.approx(2 - half, abs=1e-5) and iv.hi == pytest.approx(2 + half, abs=1e-5)


def test_one_value_has_no_interval_and_no_verdict():
    iv = stats.mean_interval([0.5])
    assert not iv.resolved and math.isnan(iv.lo)
    assert stats.verdict(iv, ">") == "not resolved"
    assert "no interval" in iv.fmt()


def test_values_without_spread_have_no_interval():
    """Two seeds with the same accuracy gain (accuracies are multiples of 1/items) give sd 0: no interval and no
    verdict, not a zero-width interval that reads as certain."""
    iv = stats.paired_difference([5 / 12] * 2, [6 / 12] * 2)
    assert iv.mean == pytest.approx(1 / 12) and not iv.resolved and math.isnan(iv.lo) and math.isnan(iv.hi)
    assert stats.verdict(iv, ">") == "not resolved"


def test_paired_difference_removes_shared_noise():
    rng = np.random.default_rng(0)
    shared = rng.normal(0, 1.0, 8)              # seed-to-seed noise common to both models
    a, b = 4.0 + shared, 3.9 + shared + rng.normal(0, 0.001, 8)
    iv = stats.paired_difference(a, b)
    assert iv.hi < 0 and iv.mean == pytest.approx(-0.1, abs=0.01)
    with pytest.raises(ValueError, match="pair up"):
        stats.paired_difference([1, 2], [1, 2, 3])


@pytest.mark.parametrize("lo, hi, claim, expected", [
    (0.1, 0.3, ">", "reproduced"), (-0.3, -0.1, ">", "contradicted"), (-0.1, 0.2, ">", "not resolved"),
    (-0.3, -0.1, "<", "reproduced"), (0.1, 0.3, "<", "contradicted"), (-0.1, 0.2, "<", "not resolved"),
    (1.1, 1.4, ">", "reproduced"),
])
def test_verdict_three_states(lo, hi, claim, expected):
    value = 1.0 if lo > 1 else 0.0
    assert stats.verdict(stats.Interval((lo + hi) / 2, lo, hi, 3), claim, value) == expected


@pytest.mark.parametrize("method", ["bootstrap", "cell bootstrap (refit)", "bootstrap over held-out document groups"])
def test_a_bootstrap_over_too_few_units_decides_nothing(method):
    """A percentile bootstrap over fewer than MIN_BOOTSTRAP_UNITS units is too narrow (docs/wins.md): wholly above
    or below 0 it is still not resolved, and fmt says why; from MIN_BOOTSTRAP_UNITS on it decides. A t-interval
    over 3 units decides (its t quantile already pays for the few units)."""
    n = stats.MIN_BOOTSTRAP_UNITS
    for lo, hi in ((0.1, 0.3), (-0.3, -0.1)):
        few = stats.Interval((lo + hi) / 2, lo, hi, n - 1, 0.95, method)
        assert few.few_units and stats.verdict(few, ">") == "not resolved"
        assert few.fmt(1).endswith(f"(bootstrap over {n - 1} units: too few to decide)")
        enough = stats.Interval((lo + hi) / 2, lo, hi, n, 0.95, method)
        assert not enough.few_units and stats.verdict(enough, ">") == ("reproduced" if lo > 0 else "contradicted")
    assert stats.verdict(stats.Interval(0.2, 0.1, 0.3, 3, 0.95, "t"), ">") == "reproduced"


def test_verdict_never_from_a_point_estimate():
    # a large point estimate with an interval that straddles 0 is not resolved
    assert stats.verdict(stats.Interval(5.0, -1.0, 11.0, 3), ">") == "not resolved"
    assert stats.verdict(None, ">") == "not resolved"
    with pytest.raises(ValueError):
        stats.verdict(stats.Interval(0, -1, 1, 3), ">=")


def test_permutation_exact_hand_computed():
    # d = (1, 2, 3): of the 8 sign patterns only (+,+,+) has mean >= 2 -> one-sided p = 1/8;
    # |mean| >= 2 also for (-,-,-) -> two-sided p = 2/8
    a, b = [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]
    assert stats.permutation_test(a, b, alternative="greater") == pytest.approx(1 / 8)
    assert stats.permutation_test(a, b) == pytest.approx(2 / 8)
    assert stats.permutation_test(a, b, alternative="less") == pytest.approx(1.0)
    assert stats.permutation_test(a, a) == 1.0


def test_permutation_sampled_for_many_pairs():
    rng = np.random.default_rng(1)
    a = rng.normal(0, 1, 40)
    assert stats.permutation_test(a + 1.0, a, n=2000, alternative="greater") < 0.01
    assert stats.permutation_test(a + rng.normal(0, 1, 40), a, n=2000) > 0.01


def test_bootstrap_interval_covers_the_truth():
    rng = np.random.default_rng(2)
    x = rng.normal(1.0, 0.5, 400)
    iv = stats.bootstrap_interval(x, n_draws=500)
    assert iv.lo < 1.0 < iv.hi


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [[1.0, 2.0]]])
def test_bad_input_is_named(bad):
    with pytest.raises(ValueError, match="x "):
        stats.mean_interval(bad)


def _reference_draws(x, stat, n_draws, seed):
    """The resamples bootstrap_interval makes: default_rng(seed), one rng.integers(0, n, n) index per draw."""
    rng = np.random.default_rng(seed)
    return np.array([stat(x[rng.integers(0, x.size, x.size)]) for _ in range(n_draws)])


@pytest.mark.parametrize("level", [0.95, 0.8])
def test_bootstrap_interval_is_the_central_percentiles_of_its_draws(level):
    """bootstrap_interval's bounds are np.percentile of its own draws at 50(1 -/+ level): [2.5, 97.5] at 95 %."""
    x = np.random.default_rng(3).exponential(1.0, 60)
    iv = stats.bootstrap_interval(x, n_draws=400, level=level, seed=7)
    want = np.percentile(_reference_draws(x, np.mean, 400, 7), [50 * (1 - level), 50 * (1 + level)])
    assert (iv.lo, iv.hi) == pytest.approx(tuple(want), rel=1e-12)
    assert iv.mean == pytest.approx(x.mean()) and (iv.n, iv.level, iv.method) == (60, level, "bootstrap")
    if level == 0.95:                     # the same as scipy's percentile bootstrap, up to Monte Carlo error
        from scipy.stats import bootstrap
        ref = bootstrap((x,), np.mean, n_resamples=4000, method="percentile", random_state=0).confidence_interval
        big = stats.bootstrap_interval(x, n_draws=4000, seed=7)
        assert (big.lo, big.hi) == pytest.approx((ref.low, ref.high), abs=0.015)


def test_sampled_permutation_p_counts_the_observed_pattern():
    """Beyond 16 pairs p = (1 + hits) / (n + 1) over n sampled sign patterns: never 0, 1/(n+1) when nothing beats d."""
    # 20 equal positive differences: only the all-plus pattern (chance 2^-20 a draw) reaches the observed mean
    assert stats.permutation_test(np.ones(20), np.zeros(20), n=999, alternative="greater") == pytest.approx(1 / 1000)
    assert stats.permutation_test(np.ones(20), np.zeros(20), n=999) == pytest.approx(1 / 1000)
    # a mixed case, hits counted by hand from the same generator (one chunk: n * m < 2^22)
    d = np.random.default_rng(8).normal(0.3, 1.0, 24)
    signs = np.random.default_rng(11).integers(0, 2, size=(500, 24)) * 2 - 1
    hits = int(((signs * d).mean(1) >= d.mean() - 1e-12).sum())
    assert 10 < hits < 490
    p = stats.permutation_test(d, np.zeros(24), n=500, seed=11, alternative="greater")
    assert p == pytest.approx((1 + hits) / 501, rel=1e-12)
    # 17 pairs (sampled) against all 2^17 sign patterns enumerated here: equal within Monte Carlo error
    d17 = d[:17]
    every = np.array(list(itertools.product((1, -1), repeat=17)), dtype=float)
    exact = float((np.abs((every * d17).mean(1)) >= abs(d17.mean()) - 1e-12).mean())
    assert stats.permutation_test(d17, np.zeros(17), n=20000, seed=2) == pytest.approx(exact, abs=0.01)


@pytest.mark.parametrize("lo, hi, claim", [(0.0, 0.3, ">"), (-0.3, 0.0, "<"), (-0.3, 0.0, ">"), (0.0, 0.3, "<")])
def test_verdict_interval_touching_the_value_is_not_resolved(lo, hi, claim):
    """An interval with a bound exactly at `value` is not wholly on either side: "not resolved" (strict rule)."""
    assert stats.verdict(stats.Interval((lo + hi) / 2, lo, hi, 3), claim) == "not resolved"
    assert stats.verdict(stats.Interval(1.0 + (lo + hi) / 2, 1.0 + lo, 1.0 + hi, 3), claim, 1.0) == "not resolved"
