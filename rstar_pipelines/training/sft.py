"""Supervised fine-tuning of the policy on chat examples, with the loss on the final answer only.

The reference trains on `source -> target` with the loss on the target (the response and EOS) only
(spec §3). Here an example is TRL's conversational format, `{"messages": [...]}`, rendered with the
model's own chat template; the target is the final assistant message and the template's
end-of-turn after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import Field

from rstar_pipelines.training.loop import (
    TrainConfig,
    batch_order,
    log_interval,
    optimizer_and_schedule,
    step,
)

IGNORE = -100  # the label transformers leaves out of the loss


class SFTTrainConfig(TrainConfig):
    """Policy SFT settings (spec §3): lr 7e-6, 2 epochs, weight decay 0.1, max length 2048."""

    epochs: int = Field(2, ge=1)
    weight_decay: float = Field(0.1, ge=0)


def sft_tokens(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are IGNORE except on the target.

    The prompt is the conversation without its final assistant message, rendered with the
    generation prompt: the exact text the policy is given at inference. The target is the rest of
    the full rendering (the answer, then the end-of-turn tokens). Each is tokenized on its own and
    the ids joined, so the boundary is exact whatever the tokenizer would merge across it, and the
    prompt tokens are those generation sees. Cut to the first `max_length` tokens.
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("an SFT example must end with an assistant message (the target)")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    if not full.startswith(prompt):
        raise ValueError(
            "the chat template does not render the conversation as its prompt (the messages before "
            "the final one, with the generation prompt) followed by the answer, so the answer "
            f"cannot be told apart: prompt {prompt[-200:]!r}, conversation {full[-200:]!r}"
        )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + target_ids)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + target_ids)[:max_length]
    return input_ids, labels


def train_sft(
    model: Any,
    tokenizer: Any,
    examples: list[dict],
    config: SFTTrainConfig,
    log: Callable[[str], Any] = print,
) -> dict:
    """Train the causal LM `model` in place on examples with `messages`; returns the metrics.

    The loss of a batch is the mean over its target tokens. Examples whose prompt alone fills
    `max_length` have no target left and are skipped (counted in `examples_skipped`).
    """
    import torch

    started = time.monotonic()
    torch.manual_seed(config.seed)
    encoded = [sft_tokens(tokenizer, ex["messages"], config.max_length) for ex in examples]
    kept = [(ids, labels) for ids, labels in encoded if any(t != IGNORE for t in labels)]
    if not kept:
        raise ValueError("no SFT example has a target within max_length")
    batches = batch_order(len(kept), config)
    optimizer, schedule = optimizer_and_schedule(model, config, len(batches), config.weight_decay)
    every = log_interval(len(batches))
    log(f"SFT: {len(kept)} examples ({len(encoded) - len(kept)} skipped), {len(batches)} steps")
    model.train()
    losses = []
    for number, indices in enumerate(batches, 1):
        batch = _padded([kept[i] for i in indices], tokenizer.pad_token_id, model.device)
        loss = model(**batch).loss
        losses.append(step(model, loss, optimizer, schedule, config))
        if number % every == 0 or number == len(batches):
            log(f"SFT step {number}/{len(batches)}: loss {losses[-1]:.4f}")
    model.eval()
    return {
        "losses": losses,
        "final_loss": losses[-1],
        "steps": len(batches),
        "examples": len(kept),
        "examples_skipped": len(encoded) - len(kept),
        "seconds": round(time.monotonic() - started, 3),
    }


def _padded(rows: list[tuple[list[int], list[int]]], pad_id: int, device: Any) -> dict:
    """A right-padded batch: padding is masked out of attention and of the loss."""
    import torch

    width = max(len(ids) for ids, _ in rows)

    def pad(values: list[int], fill: int) -> list[int]:
        return values + [fill] * (width - len(values))

    return {
        "input_ids": torch.tensor([pad(ids, pad_id) for ids, _ in rows], device=device),
        "attention_mask": torch.tensor([pad([1] * len(ids), 0) for ids, _ in rows], device=device),
        "labels": torch.tensor([pad(labels, IGNORE) for _, labels in rows], device=device),
    }
