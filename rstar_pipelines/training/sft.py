"""Supervised fine-tuning of the policy on chat examples with `trl.SFTTrainer`, the loss on the
assistant turns only.

The reference trains on `source -> target` with the loss on the target (the response and EOS) only
(docs/training.md). Here an example is TRL's conversational format, `{"messages": [...]}`, rendered
with the model's own chat template turn by turn (`chat_tokens`, the rendering generation and the
search see); every assistant message and the template's end-of-turn after it are trained, nothing
else. The mask reaches SFTTrainer as the `assistant_masks` column of a tokenized dataset, from
which it builds the labels, cuts to `max_length` and drops examples with no target left. (TRL's
own `assistant_only_loss` needs `{% generation %}` markers in the chat template, which it can add
only to the templates it knows; SmolLM2's and most fine-tuned models' are not among them.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from rstar_pipelines.training.config import LaunchConfig, TrainConfig


class SFTTrainConfig(TrainConfig):
    """Policy SFT settings (the reference's): lr 7e-6, 2 epochs, weight decay 0.1, max length
    2048, linear decay without warm-up."""

    epochs: int = Field(2, ge=1)
    weight_decay: float = Field(0.1, ge=0)


def chat_tokens(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    max_length: int | None = None,
) -> tuple[list[int], list[bool]]:
    """(input_ids, trained) of a conversation rendered with the model's chat template: `trained`
    is True on the tokens of each assistant message and the template's end-of-turn after it,
    False on the rest (system, user and tool-response turns, the template's own markup).

    Rendered turn by turn: before an assistant message, the conversation so far with the
    generation prompt (the exact text the policy is given at inference); after it, the
    conversation through it. Each rendering must extend the one before; each new piece is
    tokenized on its own and the ids joined, so the boundaries are exact whatever the tokenizer
    would merge across them, and a prompt's tokens are those generation sees. Cut to the first
    `max_length` tokens (None: not cut).
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the conversation must end with an assistant message (the target)")
    pieces: list[tuple[str, bool]] = []
    rendered = ""
    for index in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
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


def sft_dataset(tokenizer: Any, examples: Sequence[Mapping[str, Any]]) -> Any:
    """The tokenized dataset SFTTrainer reads: `input_ids` and `assistant_masks` per example."""
    from datasets import Dataset

    rows = []
    for example in examples:
        ids, trained = chat_tokens(tokenizer, example["messages"])
        rows.append({"input_ids": ids, "assistant_masks": [int(t) for t in trained]})
    return Dataset.from_list(rows)


def sft_trainer(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Mapping[str, Any]],
    config: SFTTrainConfig,
    output_dir: Path,
    log: Callable[[str], Any] = print,
    launch: LaunchConfig | None = None,
) -> Any:
    """The SFTTrainer of a job, its dataset prepared: labels on the assistant turns only (-100
    elsewhere), cut to max_length, examples without a target left dropped."""
    from transformers import PrinterCallback
    from trl import SFTConfig

    from rstar_pipelines.training import hf_trainer

    launch = launch or LaunchConfig()
    args = hf_trainer.arguments(
        SFTConfig,
        config,
        launch,
        output_dir,
        max_length=config.max_length,
        weight_decay=config.weight_decay,
    )
    trainer = _sft_trainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(tokenizer, examples),
        processing_class=tokenizer,
        peft_config=hf_trainer.peft_config(launch, "CAUSAL_LM"),
        callbacks=hf_trainer.callbacks("SFT", log),
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_sft(
    model: Any,
    tokenizer: Any,
    examples: list[dict],
    config: SFTTrainConfig,
    log: Callable[[str], Any] = print,
    *,
    output_dir: Path | None = None,
    launch: LaunchConfig | None = None,
) -> dict:
    """Train the causal LM `model` in place on examples with `messages` and, with an output_dir,
    save it there with the tokenizer; returns the metrics. Resumes from the last complete
    checkpoint under output_dir.

    The loss of a step is the mean over its trained tokens, across processes and accumulated
    micro-batches alike. Examples whose prompt alone fills `max_length` have no target left and
    are dropped (counted in `examples_skipped`).
    """
    import tempfile

    from rstar_pipelines.training import hf_trainer

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(output_dir or scratch)
        trainer = sft_trainer(model, tokenizer, examples, config, out, log, launch)
        kept = len(trainer.train_dataset)
        if not kept:
            raise ValueError("no SFT example has a target within max_length")
        skipped = len(examples) - kept
        log(f"SFT: {kept} examples ({skipped} skipped)")
        resumed = hf_trainer.train(trainer, out, log)
        hf_trainer.finish(trainer, tokenizer, out if output_dir else None)
        model.eval()
        losses = hf_trainer.logged(trainer, "loss")
        return {
            "losses": losses,
            "final_loss": losses[-1],
            "steps": trainer.state.global_step,
            "examples": kept,
            "examples_skipped": skipped,
            "resumed_from_step": resumed,
            "processes": trainer.accelerator.num_processes,
        }


def _sft_trainer(**kwargs: Any) -> Any:
    """trl.SFTTrainer; on the CPU with the model's own cross-entropy loss.

    TRL computes the loss with its chunked LM-head kernel, which never builds the full logits: a
    GPU memory saving (Triton there). Its torch fallback on the CPU is 3-4x slower than the
    plain loss on a small model, so there the loss is transformers' (`Trainer.compute_loss`,
    the same token mean over the step, across processes and accumulation). TRL's entropy and
    token-accuracy figures come with its kernel only."""
    import torch
    from transformers import Trainer
    from trl import SFTTrainer

    class CPUSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    return (SFTTrainer if torch.cuda.is_available() else CPUSFTTrainer)(**kwargs)
