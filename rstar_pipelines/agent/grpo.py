"""The GRPO update of rStar2-Agent (docs/agent.md): group-normalised outcome advantages and the PPO
clipped policy loss as the released training script configures verl: clip-higher (0.2 below,
0.28 above), token-mean over the batch, no KL term, no entropy bonus.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """`(r - mean) / (std + eps)` over one group's kept rollouts, each rollout's advantage for all
    of its tokens. `std` is the sample standard deviation (divides by n - 1), what verl's GRPO
    advantage gets from torch.std; eps 1e-6 as there. Equal rewards give 0 everywhere."""
    if len(rewards) < 2:
        raise ValueError(f"a group needs at least 2 rewards, got {len(rewards)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    mean = statistics.fmean(rewards)
    std = statistics.stdev(rewards)
    return [(reward - mean) / (std + eps) for reward in rewards]


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor | Sequence[float],
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy loss of a batch and its statistics.

    `logprobs` (with grad), `old_logprobs` (the policy before this step's updates) and `mask`
    (1 on tokens the model wrote, 0 on prompt, tool responses and padding) are [B, T];
    `advantages` is [B], one per rollout. Per token, with `ratio = exp(logprobs - old_logprobs)`:
    `max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`, and with `dual_clip` = c
    (verl's dual clip, c = 3 there; off by default) a negative-advantage token's loss is capped at
    `-A * c`. The mean is over all masked tokens of the batch (verl's "token-mean"), so a long
    rollout weighs more than a short one; call it once per optimizer step.

    Statistics, as shares of the masked tokens: clip_fraction_low (A < 0 and ratio below
    1 - clip_low), clip_fraction_high (A > 0 and ratio above 1 + clip_high), dual_clip_fraction
    (0 without a dual clip); and mean_ratio. Clipped tokens get no gradient.
    """
    import torch

    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip)
    advantage = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)[:, None]
    trained = mask > 0
    # verl bounds the log-ratio so that exp stays finite on a token the policy has moved far.
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs.detach(), -20.0, 20.0))
    token_loss = torch.maximum(
        -advantage * ratio, -advantage * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    )
    if dual_clip is not None:
        token_loss = torch.where(
            advantage < 0, torch.minimum(token_loss, -advantage * dual_clip), token_loss
        )
    tokens = trained.sum()
    loss = torch.where(trained, token_loss, 0.0).sum() / tokens

    with torch.no_grad():
        clipped_low = trained & (advantage < 0) & (ratio < 1 - clip_low)
        clipped_high = trained & (advantage > 0) & (ratio > 1 + clip_high)
        dual_clipped = (
            trained & (advantage < 0) & (ratio > dual_clip)
            if dual_clip is not None
            else torch.zeros_like(trained)
        )
        stats = {
            "clip_fraction_low": (clipped_low.sum() / tokens).item(),
            "clip_fraction_high": (clipped_high.sum() / tokens).item(),
            "dual_clip_fraction": (dual_clipped.sum() / tokens).item(),
            "mean_ratio": ratio[trained].mean().item(),
        }
    return loss, stats


def _check_loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor | Sequence[float],
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [batch, tokens], got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}"
            )
    if len(advantages) != logprobs.shape[0]:
        raise ValueError(
            f"advantages has {len(advantages)} values for a batch of {logprobs.shape[0]} rollouts"
        )
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must hold only 0 and 1")
    if not mask.any():
        raise ValueError("mask selects no token: nothing to train on")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (verl asserts it), got {dual_clip}")
