"""Figures a reader can trust on few problems: an accuracy with its 95% Wilson interval, and
the paired difference of two methods on the same problems with an exact McNemar test (a
two-sided binomial test on the problems exactly one of them answers right)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.05  # the significance level the verdicts speak of


@dataclass(frozen=True)
class Proportion:
    """`correct` of `total` with its confidence interval [low, high]."""

    correct: int
    total: int
    low: float
    high: float

    @property
    def value(self) -> float:
        return self.correct / self.total


def wilson(correct: int, total: int, confidence: float = 0.95) -> Proportion:
    """The share `correct / total` with its Wilson score interval."""
    from scipy.stats import binomtest

    if total < 1 or not 0 <= correct <= total:
        raise ValueError(
            f"wilson: {correct} correct of {total}: needs at least one problem and "
            f"0 <= correct <= total"
        )
    interval = binomtest(correct, total).proportion_ci(confidence, method="wilson")
    return Proportion(correct, total, float(interval.low), float(interval.high))


@dataclass(frozen=True)
class PairedDifference:
    """A method against its baseline on the same problems."""

    difference: float  # the method's accuracy minus the baseline's
    gained: int  # problems only the method answers right
    lost: int  # problems only the baseline answers right
    p_value: float  # exact McNemar, two-sided; 1.0 when no problem tells them apart


def mcnemar_exact(baseline: Sequence[bool], method: Sequence[bool]) -> PairedDifference:
    """`method` against `baseline`, both graded on the same problems in the same order."""
    from scipy.stats import binomtest

    if len(baseline) != len(method) or not baseline:
        raise ValueError(
            f"mcnemar_exact: {len(baseline)} baseline and {len(method)} method outcomes: "
            f"a paired test needs the same problems, at least one"
        )
    gained = sum(1 for b, m in zip(baseline, method, strict=True) if m and not b)
    lost = sum(1 for b, m in zip(baseline, method, strict=True) if b and not m)
    discordant = gained + lost
    p_value = float(binomtest(gained, discordant).pvalue) if discordant else 1.0
    return PairedDifference((gained - lost) / len(baseline), gained, lost, p_value)


def fewest_problems_for(alpha: float = ALPHA) -> int:
    """The fewest paired problems on which an exact McNemar test can reach p < alpha: every
    problem answered right by one method and wrong by the other, all the same way."""
    from scipy.stats import binomtest

    n = 1
    while binomtest(n, n).pvalue >= alpha:
        n += 1
    return n


def verdict(
    compared: Sequence[tuple[str, PairedDifference]], problems: int, alpha: float = ALPHA
) -> str:
    """In words: which of the labelled comparisons differ at p < alpha, and, when none does,
    whether any could have on this many problems."""
    differing = [(label, d) for label, d in compared if d.p_value < alpha]
    if differing:
        listed = "; ".join(
            f"{label}: {d.difference:+.3f} (p = {d.p_value:.3g})" for label, d in differing
        )
        return (
            f"{len(differing)} of {len(compared)} rows differ from their baseline at "
            f"p < {alpha} (exact McNemar, {problems} paired problems): {listed}."
        )
    fewest = fewest_problems_for(alpha)
    if problems < fewest:
        return (
            f"No row differs from its baseline at p < {alpha}, and none could: on {problems} "
            f"paired problems the exact McNemar test cannot reach p < {alpha} (that takes at "
            f"least {fewest} problems, every one of them won by the same side). These figures "
            f"cannot tell a better model from a worse one."
        )
    return (
        f"No row differs from its baseline at p < {alpha} (exact McNemar, {problems} paired "
        f"problems): the differences seen are within chance."
    )
