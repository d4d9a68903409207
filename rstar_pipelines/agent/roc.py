"""Resample-on-Correct (RoC), rStar2-Agent's rollout filter (docs/agent.md).

Each prompt gets 2G rollouts; RoC keeps G of them for the GRPO update. Negatives (reward 0) are
down-sampled uniformly, which keeps their diverse failure modes; positives (reward 1) are
down-sampled favouring a low penalty, the share of failed tool calls plus a format penalty, so
correct answers reached through erroring code are trained on less often. The reward itself stays
binary.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from typing import Literal

PositiveSelection = Literal["sample", "lowest"]

_ANSWER_BLOCK = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def tool_error_ratio(statuses: Sequence[str | None], no_call_ratio: float = 0.0) -> float:
    """The share of a trajectory's tool calls that failed: `statuses` holds one sandbox status per
    call that was answered, None for a call that did not parse or did not run; only "ok" counts as
    a success. The reference looks for "error" in the response text instead, which also flags a
    program that merely prints the word.

    A trajectory without any call gets `no_call_ratio`. The reference uses 0.5, and together with
    its format penalty (1.0 for a single-turn answer, docs/agent.md) that makes a correct answer
    without tool use the worst positive of all, so RoC pushes the policy towards calling the tool.
    Our default is 0.0: no call, no failed call. The penalty then measures what the paper names
    (tool errors in correct trajectories) and leaves it to the reward whether a problem is worth a
    tool call, which also suits code problems and small models that answer some problems
    directly. Pass 0.5 for the reference's preference for tool use.
    """
    if isinstance(statuses, str):
        raise ValueError("statuses must be a sequence of call statuses, not one string")
    if not 0 <= no_call_ratio <= 1:
        raise ValueError(f"no_call_ratio must be in [0, 1], got {no_call_ratio}")
    if not statuses:
        return no_call_ratio
    return sum(status != "ok" for status in statuses) / len(statuses)


def format_penalty(assistant_turns: Sequence[str]) -> float:
    """How badly a trajectory's answer is formatted, from its assistant turns in order
    (docs/agent.md).

    1.0 when the final turn holds no `<answer>...</answer>` block or any turn has a stray
    `<answer>` or `</answer>` tag (the reference's balance check), or when there is no turn at
    all; otherwise extra answer blocks per turn, `min((blocks - 1) / turns, 1)`, so one clean
    answer scores 0. Every assistant turn counts here; the reference misses the first one (its
    response text starts inside that turn), which gives a single-turn answer a penalty of 1.0.
    """
    if isinstance(assistant_turns, str):
        raise ValueError("assistant_turns must be a sequence of turns, not one string")
    blocks = 0
    for turn in assistant_turns:
        found = len(_ANSWER_BLOCK.findall(turn))
        if turn.count("<answer>") != found or turn.count("</answer>") != found:
            return 1.0
        blocks += found
    if not assistant_turns or not _ANSWER_BLOCK.search(assistant_turns[-1]):
        return 1.0
    return min((blocks - 1) / len(assistant_turns), 1.0)


def resample_on_correct(
    rewards: Sequence[float],
    tool_error_ratios: Sequence[float],
    format_penalties: Sequence[float],
    keep: int = 16,
    *,
    rng: random.Random,
    positive_selection: PositiveSelection = "sample",
    min_each: int = 2,
    penalty_temperature: float = 0.2,
) -> list[int]:
    """The indices of one prompt's rollouts to train on, ascending.

    A group whose rewards are all equal is dropped (returns []): it has no GRPO signal. A group of
    at most `keep` rollouts is kept whole (the reference drops one smaller than `keep`, which
    only its world-size truncation produces). Otherwise `keep` rollouts stay, split in proportion:
    `round(positives * keep / rollouts)` positives (Python's round, like the reference, so 2G -> G
    splits the same way), the rest negatives; a side below `min_each` is raised to `min_each` (or
    all it has) and the other side gets the rest.

    Negatives are drawn uniformly without replacement. Positives, by their penalty
    `tool_error_ratio + format_penalty`:
    - "sample" (the paper): drawn one at a time without replacement with probability proportional
      to `exp(-penalty / penalty_temperature)`. At the default 0.2 a penalty higher by 0.2 (one
      failed call in five) makes a rollout e times less likely, a format failure (+1) about 150
      times: clean trajectories are clearly preferred, yet a slightly worse one still gets in.
    - "lowest" (the released code): the lowest penalties, ties in rollout order.
    """
    _check_group(rewards, tool_error_ratios, format_penalties, keep, min_each)
    if positive_selection not in ("sample", "lowest"):
        raise ValueError(
            f"positive_selection must be 'sample' or 'lowest', got {positive_selection!r}"
        )
    if not penalty_temperature > 0:
        raise ValueError(f"penalty_temperature must be > 0, got {penalty_temperature}")
    if len(set(rewards)) < 2:
        return []
    if len(rewards) <= keep:
        return list(range(len(rewards)))

    positives = [i for i, reward in enumerate(rewards) if reward == 1]
    negatives = [i for i, reward in enumerate(rewards) if reward == 0]
    n_pos = round(len(positives) * keep / len(rewards))
    n_pos = max(n_pos, min(min_each, len(positives)))  # raise the positives...
    n_pos = min(n_pos, keep - min(min_each, len(negatives)))  # ...or leave the negatives theirs
    # The proportional split never asks a side for more than it has, and keep < len(rewards).
    n_neg = keep - n_pos

    penalties = [
        error + fmt for error, fmt in zip(tool_error_ratios, format_penalties, strict=True)
    ]
    if positive_selection == "lowest":
        kept_positives = sorted(positives, key=lambda i: penalties[i])[:n_pos]
    else:
        kept_positives = _sample_low_penalty(positives, penalties, n_pos, penalty_temperature, rng)
    return sorted(kept_positives + rng.sample(negatives, n_neg))


def _sample_low_penalty(
    candidates: list[int],
    penalties: list[float],
    count: int,
    temperature: float,
    rng: random.Random,
) -> list[int]:
    remaining = list(candidates)
    chosen: list[int] = []
    for _ in range(count):
        # Relative to the lowest remaining penalty, so one weight is always 1 and none underflow
        # to an all-zero draw; the probabilities are the same.
        lowest = min(penalties[i] for i in remaining)
        weights = [math.exp((lowest - penalties[i]) / temperature) for i in remaining]
        pick = rng.choices(range(len(remaining)), weights=weights)[0]
        chosen.append(remaining.pop(pick))
    return chosen


def _check_group(
    rewards: Sequence[float],
    tool_error_ratios: Sequence[float],
    format_penalties: Sequence[float],
    keep: int,
    min_each: int,
) -> None:
    for name, values in (
        ("tool_error_ratios", tool_error_ratios),
        ("format_penalties", format_penalties),
    ):
        if len(values) != len(rewards):
            raise ValueError(f"{name} has {len(values)} values but rewards has {len(rewards)}")
        for i, value in enumerate(values):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}[{i}] = {value}: penalties must be finite and >= 0")
    for i, reward in enumerate(rewards):
        if reward not in (0, 1):
            raise ValueError(f"rewards[{i}] = {reward}: rewards must be 0 or 1")
    if min_each < 0:
        raise ValueError(f"min_each must be >= 0, got {min_each}")
    if keep < max(2, 2 * min_each):
        raise ValueError(
            f"keep = {keep} must be at least 2 (a GRPO group) and at least 2 * min_each "
            f"= {2 * min_each}"
        )
