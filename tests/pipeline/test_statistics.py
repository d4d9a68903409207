"""The evaluation's statistics on values worked out by hand."""

import pytest

from rstar_pipelines.pipeline.statistics import (
    fewest_problems_for,
    mcnemar_exact,
    verdict,
    wilson,
)

Z = 1.959963984540054  # the two-sided 95% normal quantile


def test_wilson_interval():
    # At 0 of n and n of n the interval has a closed form: [0, z²/(n+z²)], [n/(n+z²), 1].
    none = wilson(0, 2)
    assert (none.value, none.low) == (0.0, 0.0)
    assert none.high == pytest.approx(Z**2 / (2 + Z**2))
    every = wilson(10, 10)
    assert every.low == pytest.approx(10 / (10 + Z**2)) and every.high == pytest.approx(1.0)
    # 5 of 10: centre 1/2, half-width z·sqrt(n/4 + z²/4) / (n + z²).
    half = wilson(5, 10)
    width = Z * (10 / 4 + Z**2 / 4) ** 0.5 / (10 + Z**2)
    assert (half.low, half.high) == (pytest.approx(0.5 - width), pytest.approx(0.5 + width))
    assert half.low == pytest.approx(0.2366, abs=1e-4)


@pytest.mark.parametrize(("correct", "total"), [(3, 2), (-1, 4), (0, 0)])
def test_wilson_refuses_impossible_counts(correct, total):
    with pytest.raises(ValueError, match=f"{correct} correct of {total}"):
        wilson(correct, total)


def test_exact_mcnemar():
    # 10 problems: both right on 2, only the method on 1, only the baseline on 7.
    baseline = [True] * 2 + [False] + [True] * 7
    method = [True] * 2 + [True] + [False] * 7
    d = mcnemar_exact(baseline, method)
    assert (d.gained, d.lost) == (1, 7)
    assert d.difference == pytest.approx(-0.6)
    # Two-sided binomial at 1/2 over the 8 discordant problems: 2 * (1 + 8) / 2^8.
    assert d.p_value == pytest.approx(2 * 9 / 256)
    # Six problems all won by the method: 2 / 2^6.
    assert mcnemar_exact([False] * 6, [True] * 6).p_value == pytest.approx(2 / 64)
    # No discordant problem: nothing tells them apart.
    same = mcnemar_exact([True, False], [True, False])
    assert (same.difference, same.p_value) == (0.0, 1.0)


def test_exact_mcnemar_needs_paired_outcomes():
    with pytest.raises(ValueError, match="3 baseline and 2 method outcomes"):
        mcnemar_exact([True, True, False], [True, False])
    with pytest.raises(ValueError, match="at least one"):
        mcnemar_exact([], [])


def test_fewest_problems_for_significance():
    # 2 / 2^5 = 0.0625, 2 / 2^6 = 0.031.
    assert fewest_problems_for(0.05) == 6
    assert fewest_problems_for(0.01) == 8  # 2 / 2^7 = 0.0156, 2 / 2^8 = 0.0078


def test_verdict_in_words():
    significant = mcnemar_exact([False] * 6, [True] * 6)
    chance = mcnemar_exact([False, True], [True, True])
    said = verdict([("round 1 greedy", significant), ("round 1 dser", chance)], 6)
    assert said.startswith("1 of 2 rows differ from their baseline at p < 0.05")
    assert "round 1 greedy: +1.000 (p = 0.0312)" in said and "dser" not in said
    few = verdict([("round 1 dser", chance)], 2)
    assert "none could: on 2 paired problems" in few and "at least 6 problems" in few
    assert "within chance" in verdict([("round 1 dser", chance)], 40)
