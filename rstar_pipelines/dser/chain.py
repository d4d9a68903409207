"""A DSER chain's states: what the chains produce (`evolve`) and the vote reads (`vote`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainState:
    """Solution s_t of one chain.

    `answer`: math, the last \\boxed{} content; code, the extracted program.
    `verdict`: the model's verification of THIS solution (made in iteration t+1): True if it
    passed (then s_{t+1} is the same solution), False if not or unparsable, None if never
    verified (the last state). `correct`: the judge's grade (None without gold).
    `signature`: code only, the program's outputs on the test inputs (None if it did not run
    cleanly on all of them). `tokens`: completion tokens spent on this state, writing it (0
    when kept from s_{t-1}) plus verifying it; a run's states add up to all its tokens.
    """

    iteration: int
    text: str
    answer: str | None
    verdict: bool | None
    correct: bool | None
    tokens: int
    signature: tuple[str, ...] | None = None
