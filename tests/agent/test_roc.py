"""Resample-on-Correct and its penalties: golden cases worked out by hand, seeded draws."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from rstar_pipelines.agent.roc import format_penalty, resample_on_correct, tool_error_ratio


def group(positives: int, negatives: int) -> list[int]:
    return [1] * positives + [0] * negatives


def kept_split(rewards: list[int], keep: int, **options) -> tuple[int, int]:
    zeros = [0.0] * len(rewards)
    kept = resample_on_correct(rewards, zeros, zeros, keep, rng=random.Random(0), **options)
    assert kept == sorted(set(kept)) and len(kept) == keep
    return sum(rewards[i] for i in kept), sum(1 - rewards[i] for i in kept)


def keep_counts(draws: int, rewards, errors, formats, keep, **options) -> Counter:
    rng = random.Random(1234)
    counts: Counter = Counter()
    for _ in range(draws):
        counts.update(resample_on_correct(rewards, errors, formats, keep, rng=rng, **options))
    return counts


@pytest.mark.parametrize("rewards", [group(32, 0), group(0, 32), group(3, 0), []])
def test_groups_with_equal_rewards_are_dropped(rewards):
    zeros = [0.0] * len(rewards)
    assert resample_on_correct(rewards, zeros, zeros, 16, rng=random.Random(0)) == []


@pytest.mark.parametrize("rewards", [[1, 0], [0, 1, 1], group(8, 8)])
def test_a_group_no_larger_than_keep_is_kept_whole(rewards):
    zeros = [0.0] * len(rewards)
    kept = resample_on_correct(rewards, zeros, zeros, 16, rng=random.Random(0))
    assert kept == list(range(len(rewards)))


@pytest.mark.parametrize(
    ("positives", "negatives", "keep", "expected"),
    [
        (20, 12, 16, (10, 6)),  # 20 * 16 / 32 = 10
        (7, 25, 16, (4, 12)),  # 3.5 rounds to the even 4 (Python's round, as the reference)
        (9, 23, 16, (4, 12)),  # 4.5 rounds to the even 4
        (5, 27, 16, (2, 14)),  # 2.5 -> 2, already the minimum
        (3, 29, 16, (2, 14)),  # 1.5 -> 2
        (2, 30, 16, (2, 14)),  # 1 raised to min_each = 2
        (1, 31, 16, (1, 15)),  # 0.5 -> 0, raised to all there is (1); negatives get the rest
        (30, 2, 16, (14, 2)),  # negatives: 1 raised to 2, positives give way
        (31, 1, 16, (15, 1)),  # negatives: 0.5 -> 0, raised to the one there is
        (1, 4, 4, (1, 3)),  # 0.8 -> 1; 3 negatives, never more than the 4 available
        (4, 1, 4, (3, 1)),
        (6, 6, 6, (3, 3)),
    ],
)
def test_split_between_positives_and_negatives(positives, negatives, keep, expected):
    assert kept_split(group(positives, negatives), keep) == expected


def test_min_each_is_configurable():
    # 2 * 16 / 32 = 1 positive: kept with min_each = 1, raised to 4 with min_each = 4.
    assert kept_split(group(2, 30), 16, min_each=1) == (1, 15)
    assert kept_split(group(6, 26), 16, min_each=4) == (4, 12)
    assert kept_split(group(2, 30), 16, min_each=0) == (1, 15)


def test_lowest_takes_the_lowest_penalties_with_ties_in_rollout_order():
    rewards = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    errors = [0.5, 0.0, 0.25, 0.0, 0.5, 0, 0, 0, 0, 0, 0, 0]
    formats = [0.0, 0.0, 0.25, 0.0, 0.0, 1, 1, 1, 1, 1, 1, 1]
    # 5 * 6 / 12 = 2.5 -> 2 positives: the two penalty-0 ones (1 and 3).
    kept = resample_on_correct(
        rewards, errors, formats, 6, rng=random.Random(0), positive_selection="lowest"
    )
    assert [i for i in kept if rewards[i]] == [1, 3]
    # Penalties 0.5 (0, 2 via 0.25 + 0.25, 4) tie after those; stable order picks 0 first.
    kept = resample_on_correct(
        rewards, errors, formats, 8, rng=random.Random(0), positive_selection="lowest"
    )
    # 5 * 8 / 12 = 3.33 -> 3 positives
    assert [i for i in kept if rewards[i]] == [0, 1, 3]


def test_sample_keeps_a_low_penalty_far_more_often_but_not_always():
    rewards = group(6, 6)
    errors = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5] + [0.0] * 6
    draws = 2000
    counts = keep_counts(draws, rewards, errors, [0.0] * 12, 6)  # 3 positives of 6
    shares = [counts[i] / draws for i in range(6)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] > 0.8
    assert 0.05 < shares[5] < 0.3
    assert shares[0] > 4 * shares[5]
    assert sum(counts[i] for i in range(6)) == 3 * draws


@pytest.mark.parametrize("temperature", [0.2, 0.1])
def test_sample_weights_are_exp_of_minus_penalty_over_temperature(temperature):
    # One positive of two is kept (2 * 4 / 8 = 1, min_each 1); penalties 0 and 0.2 (as a format
    # penalty), so P(first) = 1 / (1 + exp(-0.2 / temperature)): 0.731 at 0.2, 0.881 at 0.1.
    rewards = group(2, 6)
    formats = [0.0, 0.2] + [0.0] * 6
    draws = 4000
    counts = keep_counts(
        draws, rewards, [0.0] * 8, formats, 4, min_each=1, penalty_temperature=temperature
    )
    expected = 1 / (1 + math.exp(-0.2 / temperature))
    assert counts[0] / draws == pytest.approx(expected, abs=0.03)
    assert counts[0] + counts[1] == draws


def test_negatives_are_kept_uniformly_whatever_their_penalty():
    rewards = group(6, 6)
    errors = [0.0] * 6 + [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    draws = 2000
    for selection in ("sample", "lowest"):
        counts = keep_counts(draws, rewards, errors, [0.0] * 12, 6, positive_selection=selection)
        for i in range(6, 12):
            assert counts[i] / draws == pytest.approx(0.5, abs=0.05)  # 3 of 6, sd 0.011


def test_the_same_seed_gives_the_same_selection():
    rewards = group(10, 22)
    errors = [i / 32 for i in range(32)]
    runs = [
        resample_on_correct(rewards, errors, [0.0] * 32, 16, rng=random.Random(7)) for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("arguments", "options", "message"),
    [
        (([1, 0], [0.0], [0.0, 0.0]), {}, "tool_error_ratios has 1 values but rewards has 2"),
        (([1, 0], [0.0, 0.0], [0.0]), {}, "format_penalties has 1 values but rewards has 2"),
        (([1, 0.5], [0.0, 0.0], [0.0, 0.0]), {}, r"rewards\[1\] = 0.5"),
        (([1, 0], [0.0, -0.1], [0.0, 0.0]), {}, r"tool_error_ratios\[1\] = -0.1"),
        (([1, 0], [0.0, 0.0], [math.nan, 0.0]), {}, r"format_penalties\[0\] = nan"),
        (([1, 0], [0.0, 0.0], [0.0, 0.0]), {"keep": 3}, r"keep = 3 .* 2 \* min_each = 4"),
        (([1, 0], [0.0, 0.0], [0.0, 0.0]), {"keep": 1, "min_each": 0}, "keep = 1"),
        (([1, 0], [0.0, 0.0], [0.0, 0.0]), {"min_each": -1}, "min_each must be >= 0"),
        (([1, 0], [0.0, 0.0], [0.0, 0.0]), {"positive_selection": "best"}, "'best'"),
        (([1, 0], [0.0, 0.0], [0.0, 0.0]), {"penalty_temperature": 0.0}, "penalty_temperature"),
    ],
)
def test_bad_input_is_named(arguments, options, message):
    options = {"keep": 16, **options}
    with pytest.raises(ValueError, match=message):
        resample_on_correct(*arguments, rng=random.Random(0), **options)


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (["ok", "ok", "ok", "ok"], 0.0),
        (["ok", "error", None, "timeout"], 0.75),  # None: the call did not parse or run
        ([None], 1.0),
        (["ok", "runtime_error", "ok"], 1 / 3),
    ],
)
def test_tool_error_ratio_counts_every_status_but_ok_as_failed(statuses, expected):
    assert tool_error_ratio(statuses) == pytest.approx(expected)


def test_tool_error_ratio_without_calls_is_the_declared_value():
    assert tool_error_ratio([]) == 0.0
    assert tool_error_ratio([], no_call_ratio=0.5) == 0.5  # the reference's choice
    assert tool_error_ratio(["ok"], no_call_ratio=0.5) == 0.0
    with pytest.raises(ValueError, match="no_call_ratio must be in"):
        tool_error_ratio([], no_call_ratio=1.5)
    with pytest.raises(ValueError, match="not one string"):
        tool_error_ratio("ok")


@pytest.mark.parametrize(
    ("turns", "expected"),
    [
        (["<answer>\\boxed{2}</answer>"], 0.0),
        (['<tool_call>{"name": "python"}</tool_call>', "so <answer>2</answer>"], 0.0),
        # 2 blocks over 1 turn: (2 - 1) / 1
        (["<answer>1</answer> wait, <answer>2</answer>"], 1.0),
        # 2 blocks over 4 turns: (2 - 1) / 4
        (["a", "<answer>1</answer>", "c", "<answer>2</answer>"], 0.25),
        # 4 blocks over 2 turns: min(3 / 2, 1)
        (["<answer>1</answer><answer>1</answer>", "<answer>2</answer><answer>2</answer>"], 1.0),
        (["<answer>2</answer>", "a tool call after the answer"], 1.0),  # final turn: no answer
        (["no answer at all"], 1.0),
        (["<answer>2"], 1.0),
        (["<answer>2</answer></answer>"], 1.0),  # a stray closing tag
        (["<answer>1", "<answer>2</answer>"], 1.0),  # a stray tag in an earlier turn
        ([], 1.0),
    ],
)
def test_format_penalty(turns, expected):
    assert format_penalty(turns) == pytest.approx(expected)


def test_format_penalty_rejects_a_bare_string():
    with pytest.raises(ValueError, match="not one string"):
        format_penalty("<answer>2</answer>")
