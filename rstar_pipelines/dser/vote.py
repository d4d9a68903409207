"""The DSER vote: plurality over the answers of the last K states of all chains of a problem.

Math answers fall into classes of `equivalent` answers (`majority_answer`: ``1/2`` and
``0.5`` are one class); programs into classes of identical output signatures on the test
inputs, so two different programs printing the same outputs vote together. A state without
an answer (no box, no program, a program that failed on some input) votes for nothing.
Ties go to the class whose first member comes first in pooling order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rstar_pipelines.dser.chain import ChainState
from rstar_pipelines.math.answers import majority_answer

__all__ = ["Vote", "last_states", "vote"]


@dataclass(frozen=True)
class Vote:
    """The winning class's first answer (math: the answer, code: the program), its share of
    the pooled states, its members (indices into the pool) and whether it is correct."""

    answer: str | None
    share: float
    members: tuple[int, ...]
    correct: bool | None


def last_states(chains: Sequence[Sequence[ChainState]], last: int) -> list[ChainState]:
    """The last `last` states of every chain: chain 0's in iteration order, then chain 1's..."""
    if last < 1:
        raise ValueError(f"the vote needs at least the last state of each chain, not last={last}")
    return [state for chain in chains for state in chain[-last:]]


def vote(states: Sequence[ChainState], domain: str) -> Vote:
    """Plurality of `states` (see the module docstring). Correct is the winner's grade; with
    no winner it is False if the states are graded (no answer is a wrong answer), else None."""
    if domain == "math":
        majority = majority_answer([s.answer for s in states], threshold=0.0)
        members = majority.members
    elif domain == "code":
        members = _largest_signature_class(states)
    else:
        raise ValueError(f"cannot vote in domain {domain!r}: not math or code")
    if not members:
        graded = any(s.correct is not None for s in states)
        return Vote(None, 0.0, (), False if graded else None)
    winner = states[members[0]]
    return Vote(winner.answer, len(members) / len(states), members, winner.correct)


def _largest_signature_class(states: Sequence[ChainState]) -> tuple[int, ...]:
    classes: dict[tuple[str, ...], list[int]] = {}
    for index, state in enumerate(states):
        if state.signature is not None:
            classes.setdefault(state.signature, []).append(index)
    # dicts keep first-seen order and max() keeps the first of equal sizes.
    return tuple(max(classes.values(), key=len, default=()))
