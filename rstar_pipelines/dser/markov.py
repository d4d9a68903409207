"""The two-state Markov view of DSER chains (docs/dser.md).

Each state of a chain is correct (C) or incorrect (I). Counting the transitions between
consecutive states estimates p_improve = P(I -> C) and p_degrade = P(C -> I); the chain's
long-run accuracy is then p_improve / (p_improve + p_degrade), which exceeds 1/2 exactly when
p_improve > p_degrade, and the accuracy after t steps approaches it geometrically.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MarkovEstimate",
    "TransitionCounts",
    "accuracy_after",
    "accuracy_by_iteration",
    "estimate",
    "observed_accuracy",
    "transition_counts",
]


@dataclass(frozen=True)
class TransitionCounts:
    """Transitions between consecutive states: cc = C->C, ci = C->I, ic = I->C, ii = I->I."""

    cc: int = 0
    ci: int = 0
    ic: int = 0
    ii: int = 0

    def __add__(self, other: TransitionCounts) -> TransitionCounts:
        return TransitionCounts(
            self.cc + other.cc, self.ci + other.ci, self.ic + other.ic, self.ii + other.ii
        )


@dataclass(frozen=True)
class MarkovEstimate:
    """None where undefined: p_improve when no state was incorrect before the last, p_degrade
    when none was correct, predicted when either is None or both are 0 (a chain that never
    moves keeps its start, which the counts do not tell)."""

    p_improve: float | None
    p_degrade: float | None
    predicted: float | None


def transition_counts(chains: Sequence[Sequence[bool | None]]) -> TransitionCounts:
    """Count the transitions of every chain (a sequence of per-state correctness)."""
    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for index, chain in enumerate(chains):
        _check_graded(chain, index)
        for before, after in itertools.pairwise(chain):
            counts[(before, after)] += 1
    return TransitionCounts(
        cc=counts[(True, True)],
        ci=counts[(True, False)],
        ic=counts[(False, True)],
        ii=counts[(False, False)],
    )


def estimate(counts: TransitionCounts) -> MarkovEstimate:
    p_improve = _ratio(counts.ic, counts.ic + counts.ii)
    p_degrade = _ratio(counts.ci, counts.ci + counts.cc)
    if p_improve is None or p_degrade is None or p_improve + p_degrade == 0:
        return MarkovEstimate(p_improve, p_degrade, None)
    return MarkovEstimate(p_improve, p_degrade, p_improve / (p_improve + p_degrade))


def observed_accuracy(chains: Sequence[Sequence[bool | None]], last: int) -> float | None:
    """Fraction of correct states among the last `last` states of all chains (the states the
    vote pools); None when there are none."""
    if last < 1:
        raise ValueError(f"observed accuracy needs last >= 1, not {last}")
    for index, chain in enumerate(chains):
        _check_graded(chain, index)
    pooled = [state for chain in chains for state in chain[-last:]]
    return _ratio(sum(pooled), len(pooled))


def accuracy_by_iteration(chains: Sequence[Sequence[bool | None]]) -> list[float]:
    """Per iteration t, the fraction of chains whose state s_t is correct."""
    for index, chain in enumerate(chains):
        _check_graded(chain, index)
    if len({len(chain) for chain in chains}) > 1:
        raise ValueError(f"chains of different lengths: {[len(chain) for chain in chains]}")
    return [sum(states) / len(states) for states in zip(*chains, strict=True)]


def accuracy_after(p0: float, p_improve: float, p_degrade: float, t: int) -> float:
    """P_t(C) = pi + (p0 - pi) * (1 - p_improve - p_degrade)^t with pi the stationary
    accuracy; p0 when the chain never moves (p_improve = p_degrade = 0)."""
    for name, value in (("p0", p0), ("p_improve", p_improve), ("p_degrade", p_degrade)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} is not a probability")
    if t < 0:
        raise ValueError(f"t={t} must be >= 0")
    if p_improve + p_degrade == 0:
        return p0
    stationary = p_improve / (p_improve + p_degrade)
    return stationary + (p0 - stationary) * (1.0 - p_improve - p_degrade) ** t


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def _check_graded(chain: Sequence[bool | None], index: int) -> None:
    if any(not isinstance(state, bool) for state in chain):
        raise ValueError(
            f"chain {index} has ungraded states (correct must be True or False): {list(chain)}"
        )
