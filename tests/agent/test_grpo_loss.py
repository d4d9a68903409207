"""GRPO advantages and the clipped policy loss, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rstar_pipelines.agent.grpo import group_advantages, grpo_loss


def test_advantages_use_the_sample_standard_deviation():
    # mean 0.6; sum of squares 3 * 0.4^2 + 2 * 0.6^2 = 1.2; / (n - 1 = 4) = 0.3
    std = math.sqrt(0.3)
    expected = [value / (std + 1e-6) for value in (0.4, -0.6, -0.6, 0.4, 0.4)]
    assert group_advantages([1, 0, 0, 1, 1]) == pytest.approx(expected, rel=1e-12)
    assert torch.tensor([1.0, 0, 0, 1, 1], dtype=torch.float64).std().item() == pytest.approx(std)


def test_advantages_of_a_pair_and_the_eps():
    # [0, 1]: mean 0.5, sample std sqrt(0.5) = 0.7071 (the population std 0.5 would give +-1).
    std = math.sqrt(0.5)
    expected = [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert group_advantages([0, 1]) == pytest.approx(expected, rel=1e-12)
    assert group_advantages([0, 1], eps=1.0) == pytest.approx([-0.5 / (std + 1), 0.5 / (std + 1)])
    assert group_advantages([0, 1])[1] == pytest.approx(0.7071, abs=1e-4)


def test_equal_rewards_give_zero_advantages():
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("rewards", "eps", "message"),
    [([1], 1e-6, "at least 2 rewards"), ([0, 1], 0.0, "eps must be > 0")],
)
def test_advantages_bad_input(rewards, eps, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, eps=eps)


# Rollout 0 has advantage +1, rollout 1 advantage -0.5; old log-probs 0, so ratio = exp(logprob).
RATIOS = [[1.5, 1.0, 0.5, 3.0], [0.5, 1.2, 1.5, 0.9]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
ADVANTAGES = [1.0, -0.5]


def hand_example(**options):
    logprobs = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_()
    old = torch.zeros(2, 4, dtype=torch.float64)
    loss, stats = grpo_loss(
        logprobs, old, torch.tensor(ADVANTAGES), torch.tensor(MASK, dtype=torch.float64), **options
    )
    loss.backward()
    return loss.item(), logprobs.grad, stats


def test_loss_clips_both_sides_and_averages_over_masked_tokens():
    loss, grad, stats = hand_example()
    # Per-token loss max(-A * r, -A * clip(r, 0.8, 1.28)):
    # rollout 0 (A = +1): r 1.5 > 1.28 clipped -> -1.28; r 1.0 -> -1.0;
    #   r 0.5 -> max(-0.5, -0.8) = -0.5 (A > 0 is not clipped below); r 3.0 masked.
    # rollout 1 (A = -0.5): r 0.5 < 0.8 clipped -> 0.5 * 0.8 = 0.4; r 1.2 -> 0.6;
    #   r 1.5 -> max(0.75, 0.64) = 0.75 (A < 0 is not clipped above); r 0.9 -> 0.45.
    # Token mean over the 7 masked tokens: (-2.78 + 2.2) / 7 = -0.58 / 7.
    # (A mean per rollout first would give (-2.78 / 3 + 2.2 / 4) / 2 = -0.188.)
    assert loss == pytest.approx(-0.58 / 7, rel=1e-9)
    # d loss / d logprob = -A * r / 7 where unclipped (d r / d logprob = r); 0 where clipped/masked.
    expected = torch.tensor(
        [[0.0, -1.0 / 7, -0.5 / 7, 0.0], [0.0, 0.5 * 1.2 / 7, 0.5 * 1.5 / 7, 0.5 * 0.9 / 7]],
        dtype=torch.float64,
    )
    assert torch.allclose(grad, expected, rtol=1e-9, atol=0)
    assert grad[0, 0] == 0 and grad[1, 0] == 0 and grad[0, 3] == 0
    assert stats == pytest.approx(
        {
            "clip_fraction_low": 1 / 7,
            "clip_fraction_high": 1 / 7,
            "dual_clip_fraction": 0.0,
            "mean_ratio": (1.5 + 1.0 + 0.5 + 0.5 + 1.2 + 1.5 + 0.9) / 7,
        }
    )
    assert all(isinstance(value, float) for value in stats.values())


def test_clip_bounds_are_parameters():
    # clip_high 0.6: r 1.5 of rollout 0 is no longer clipped -> -1.5 and gradient -1.5 / 7.
    loss, grad, stats = hand_example(clip_high=0.6)
    assert loss == pytest.approx((-1.5 - 1.0 - 0.5 + 2.2) / 7, rel=1e-9)
    assert grad[0, 0].item() == pytest.approx(-1.5 / 7)
    assert stats["clip_fraction_high"] == 0.0


def test_dual_clip_caps_the_loss_of_negative_advantages():
    logprobs = torch.log(torch.tensor([[4.0, 2.0], [4.0, 1.0]], dtype=torch.float64))
    logprobs.requires_grad_()
    old = torch.zeros(2, 2, dtype=torch.float64)
    advantages = torch.tensor([-0.5, 0.0])
    mask = torch.ones(2, 2)
    # Rollout 0 (A = -0.5): r 4 -> min(max(2.0, 0.64), 0.5 * 3) = 1.5, no gradient; r 2 -> 1.0.
    # Rollout 1 (A = 0): loss 0 but its 2 tokens count in the mean: (1.5 + 1.0) / 4.
    loss, stats = grpo_loss(logprobs, old, advantages, mask, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.5 / 4)
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2.0 / 4])
    assert logprobs.grad[1].tolist() == [0.0, 0.0]
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 4)
    # Off by default: r 4 costs 0.5 * 4 = 2.0 and keeps its gradient.
    plain, stats = grpo_loss(logprobs, old, advantages, mask)
    assert plain.item() == pytest.approx(3.0 / 4)
    assert stats["dual_clip_fraction"] == 0.0


def test_old_logprobs_get_no_gradient():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2, requires_grad=True)
    loss, _ = grpo_loss(logprobs, old, [1.0], torch.ones(1, 2))
    loss.backward()
    assert old.grad is None
    assert logprobs.grad.tolist() == [[-0.5, -0.5]]  # -A * r / 2 at r = 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"old": torch.zeros(2, 3)}, r"old_logprobs has shape \(2, 3\), logprobs \(2, 4\)"),
        ({"mask": torch.ones(2, 3)}, r"mask has shape \(2, 3\)"),
        ({"advantages": [1.0]}, "advantages has 1 values for a batch of 2"),
        ({"mask": torch.zeros(2, 4)}, "mask selects no token"),
        ({"mask": torch.full((2, 4), 0.5)}, "mask must hold only 0 and 1"),
        ({"logprobs": torch.zeros(8)}, r"logprobs must be \[batch, tokens\]"),
        ({"clip_low": 1.0}, r"clip_low must be in \[0, 1\)"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
    ],
)
def test_loss_bad_input(change, message):
    inputs = {
        "logprobs": torch.zeros(2, 4),
        "old": torch.zeros(2, 4),
        "advantages": [1.0, -1.0],
        "mask": torch.ones(2, 4),
    }
    options = {key: value for key, value in change.items() if key not in inputs}
    inputs.update({key: value for key, value in change.items() if key in inputs})
    with pytest.raises(ValueError, match=message):
        grpo_loss(
            inputs["logprobs"], inputs["old"], inputs["advantages"], inputs["mask"], **options
        )
