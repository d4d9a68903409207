"""The Markov view of DSER chains on hand-made correctness sequences; numbers by hand."""

from __future__ import annotations

import pytest

from rstar_pipelines.dser.markov import (
    MarkovEstimate,
    TransitionCounts,
    accuracy_after,
    accuracy_by_iteration,
    estimate,
    observed_accuracy,
    transition_counts,
)

T, F = True, False


def test_counts_and_estimate_by_hand():
    chains = [[F, T, T, F], [T, T], [F, F, T], [], [T]]
    # chain 0: I->C, C->C, C->I; chain 1: C->C; chain 2: I->I, I->C; the rest: none
    counts = transition_counts(chains)
    assert counts == TransitionCounts(cc=2, ci=1, ic=2, ii=1)
    # p_improve = ic/(ic+ii) = 2/3, p_degrade = ci/(ci+cc) = 1/3, predicted = 2/3 / 1
    result = estimate(counts)
    assert result.p_improve == pytest.approx(2 / 3)
    assert result.p_degrade == pytest.approx(1 / 3)
    assert result.predicted == pytest.approx(2 / 3)


def test_counts_add_up_over_problems():
    total = transition_counts([[F, T]]) + transition_counts([[T, F, F]])
    assert total == TransitionCounts(cc=0, ci=1, ic=1, ii=1)


@pytest.mark.parametrize(
    ("chains", "expected"),
    [
        # never incorrect before the end: p_improve undefined
        ([[T, T, T]], MarkovEstimate(None, 0.0, None)),
        # never correct: p_degrade undefined
        ([[F, F]], MarkovEstimate(0.0, None, None)),
        # no transitions at all
        ([[T], [F]], MarkovEstimate(None, None, None)),
        # both defined but both 0: the chains never move, the long run is their start
        ([[F, F], [T, T]], MarkovEstimate(0.0, 0.0, None)),
        # always flipping: p_improve = p_degrade = 1, predicted 1/2
        ([[F, T, F, T]], MarkovEstimate(1.0, 1.0, 0.5)),
    ],
)
def test_undefined_estimates_are_none(chains, expected):
    assert estimate(transition_counts(chains)) == expected


def test_ungraded_states_are_rejected():
    with pytest.raises(ValueError, match="chain 1 has ungraded states"):
        transition_counts([[T, F], [F, None]])
    with pytest.raises(ValueError, match="chain 0 has ungraded states"):
        observed_accuracy([[None]], last=1)


def test_observed_accuracy_pools_the_last_states():
    chains = [[F, T, T], [F, F, T], [T, F, F]]
    # last 2: (T, T), (F, T), (F, F) -> 3 of 6
    assert observed_accuracy(chains, last=2) == pytest.approx(0.5)
    # last 1: T, T, F
    assert observed_accuracy(chains, last=1) == pytest.approx(2 / 3)
    assert observed_accuracy([], last=1) is None
    with pytest.raises(ValueError, match="last >= 1"):
        observed_accuracy(chains, last=0)


def test_accuracy_by_iteration():
    assert accuracy_by_iteration([[F, T, T], [F, F, T]]) == [0.0, 0.5, 1.0]
    assert accuracy_by_iteration([]) == []
    with pytest.raises(ValueError, match="different lengths"):
        accuracy_by_iteration([[F, T], [F]])


def test_accuracy_after_by_hand():
    # p0 = 0, p_improve = 0.3, p_degrade = 0.1: stationary 0.75.
    # t=1: every chain starts incorrect, so P1 = p_improve = 0.3.
    # t=2: P1*(1-p_degrade) + (1-P1)*p_improve = 0.27 + 0.21 = 0.48.
    assert accuracy_after(0.0, 0.3, 0.1, 0) == 0.0
    assert accuracy_after(0.0, 0.3, 0.1, 1) == pytest.approx(0.3)
    assert accuracy_after(0.0, 0.3, 0.1, 2) == pytest.approx(0.48)
    assert accuracy_after(0.0, 0.3, 0.1, 200) == pytest.approx(0.75)
    assert accuracy_after(0.4, 0.0, 0.0, 5) == 0.4
    with pytest.raises(ValueError, match="p_degrade=1.5 is not a probability"):
        accuracy_after(0.5, 0.1, 1.5, 1)
    with pytest.raises(ValueError, match="t=-1"):
        accuracy_after(0.5, 0.1, 0.1, -1)
