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
    """(input_ids, labels) of one conversation; labels are IGNORE except on the target, the final
    assistant message (`chat_tokens` with `final_only`)."""
    input_ids, trained = chat_tokens(tokenizer, messages, max_length, final_only=True)
    return input_ids, [t if keep else IGNORE for t, keep in zip(input_ids, trained, strict=True)]


def chat_tokens(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    max_length: int,
    *,
    final_only: bool = False,
) -> tuple[list[int], list[bool]]:
    """(input_ids, trained) of a conversation rendered with the model's chat template: `trained`
    is True on the tokens of each assistant message and the template's end-of-turn after it,
    False on the rest (system, user and tool-response turns, the template's own markup).
    With `final_only`, only the final assistant message is trained; earlier ones are prompt.

    Rendered turn by turn: before a trained message, the conversation so far with the generation
    prompt (the exact text the policy is given at inference); after it, the conversation through
    it. Each rendering must extend the one before; each new piece is tokenized on its own and the
    ids joined, so the boundaries are exact whatever the tokenizer would merge across them, and a
    prompt's tokens are those generation sees. Cut to the first `max_length` tokens.
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the conversation must end with an assistant message (the target)")
    targets = [len(messages) - 1] if final_only else _assistant_indices(messages)
    pieces: list[tuple[str, bool]] = []
    rendered = ""
    for index in targets:
        prompt = tokenizer.apply_chat_template(
            messages[:index], tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise ValueError(
                "the chat template does not render the conversation as its prompt (the messages "
                "before an assistant message, with the generation prompt) followed by that "
                "message, so the message cannot be told apart: rendered so far "
                f"{rendered[-200:]!r}, prompt {prompt[-200:]!r}, conversation {full[-200:]!r}"
            )
        pieces += [(prompt[len(rendered) :], False), (full[len(prompt) :], True)]
        rendered = full
    input_ids: list[int] = []
    trained: list[bool] = []
    for text, is_target in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        input_ids += ids
        trained += [is_target] * len(ids)
    return input_ids[:max_length], trained[:max_length]


def _assistant_indices(messages: list[dict[str, str]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


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
