"""Means, standard deviations and the 95 % Welch t interval of a difference of means.

The Student t quantile is computed here (the regularized incomplete beta function by its
continued fraction, inverted by bisection), so the lab needs no statistics package.
"""

from __future__ import annotations

import math

INTERVAL = ("95% Welch t interval of mean(variant) - mean(baseline) over seeds: unequal "
            "variances, Welch-Satterthwaite degrees of freedom")


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """The mean and the sample standard deviation (None for a single value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p, for p in (0.5, 1)."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def welch(variant: list[float], baseline: list[float]) -> dict:
    """The difference of means, its 95 % Welch interval and degrees of freedom, and whether
    the interval holds 0 (``within_noise``). With fewer than two values on a side there is no
    interval: interval, df and within_noise are None."""
    mv, sv = mean_std(variant)
    mb, sb = mean_std(baseline)
    difference = mv - mb
    if sv is None or sb is None:
        return {"difference": difference, "interval": None, "df": None, "within_noise": None}
    a, b = sv * sv / len(variant), sb * sb / len(baseline)
    se = math.sqrt(a + b)
    if se == 0.0:  # identical values on both sides: the difference is exact
        return {"difference": difference, "interval": [difference, difference], "df": None,
                "within_noise": difference == 0.0}
    df = (a + b) ** 2 / (a * a / (len(variant) - 1) + b * b / (len(baseline) - 1))
    half = t_quantile(0.975, df) * se
    lo, hi = difference - half, difference + half
    return {"difference": difference, "interval": [lo, hi], "df": df,
            "within_noise": lo <= 0.0 <= hi}
