"""What the PPM and SFT trainers share: the config fields, the batch order and the optimizer."""

from __future__ import annotations

import math
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    """Settings every training job has. Defaults follow the reference where it has one (spec §2.4,
    §3); its effective batch (512 pairs, 128 examples) comes from many GPUs and gradient
    accumulation, which this single-process trainer does not do."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(7e-6, gt=0, description="peak learning rate, decayed linearly to 0")
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(2048, ge=2, description="most tokens per sequence")
    seed: int = Field(0, ge=0, description="torch, the batch order, the held-out split")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the gradient norm (the HF Trainer default); None: no clipping"
    )


def batch_order(count: int, config: TrainConfig) -> list[list[int]]:
    """Index batches for the whole run: each epoch a fresh shuffle seeded by `config.seed`, cut at
    `max_steps`. Known up front, so the learning-rate schedule knows its length."""
    rng = random.Random(config.seed)
    batches: list[list[int]] = []
    for _ in range(config.epochs):
        order = list(range(count))
        rng.shuffle(order)
        batches += [order[i : i + config.batch_size] for i in range(0, count, config.batch_size)]
    return batches[: config.max_steps]


def optimizer_and_schedule(
    model: Any, config: TrainConfig, steps: int, weight_decay: float = 0.0
) -> tuple[Any, Any]:
    """AdamW with a linear decay to zero and no warm-up, as the reference's runs use."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    return optimizer, schedule


def step(model: Any, loss: Any, optimizer: Any, schedule: Any, config: TrainConfig) -> float:
    """One optimizer step on `loss`; returns its value."""
    import torch

    optimizer.zero_grad()
    loss.backward()
    if config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    schedule.step()
    return loss.item()


def log_interval(steps: int) -> int:
    """Log about 20 times per run, and every step of a short one."""
    return max(1, math.ceil(steps / 20))
