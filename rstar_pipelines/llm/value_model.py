"""The process preference model (PPM) of rStar-Math as the search uses it: load a trained PPM
directory and score partial solutions (docs/rstar-math.md). Training it is
rstar_pipelines.training.ppm's job; this half needs no training code, so the search stages import
it from here.

A PPM is a plain Hugging Face sequence-classification directory with one label (the policy's
backbone plus a scalar head) and the step tags as special tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rstar_pipelines.llm import torch_thread
from rstar_pipelines.llm.types import Prompt, is_chat, render_chat

if TYPE_CHECKING:
    import torch


def ppm_input(tokenizer: Any, prompt: str, completion: str) -> str:
    """The text the PPM reads for a prompt and a (partial) solution, in training and scoring alike.

    The chat template renders the prompt as the user turn and the completion as an assistant turn
    left open (no end-of-turn token), so the value read at the last token judges the solution so
    far, as the policy's own prompt would continue it.
    """
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return render_chat(tokenizer, messages)


class ProcessPreferenceModel:
    """A PPM in this process: scores partial solutions (training: rstar_pipelines.training.ppm).

    Texts are tokenized as they are (the chat template already holds its special tokens) and cut to
    their last `max_length` tokens: the value is read at the last token, so the end of the solution
    (the step being judged) is what must stay.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, max_length: int = 2048):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        # A loaded PPM scores on the torch thread, as the LLMs it searches with generate
        # (module `torch_thread`); one being trained, on its trainer's thread.
        self._on_torch_thread = False

    @classmethod
    def load(cls, directory: str | Path, **options: Any) -> ProcessPreferenceModel:
        """A PPM saved by `save` (or any one-label sequence-classification directory)."""
        ppm = torch_thread.run(cls._load, directory, **options)
        ppm._on_torch_thread = True
        return ppm

    @classmethod
    def _load(cls, directory: str | Path, **options: Any) -> ProcessPreferenceModel:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32)
        if model.config.num_labels != 1:
            raise ValueError(f"{directory} has {model.config.num_labels} labels; a PPM has one")
        return cls(model.eval(), AutoTokenizer.from_pretrained(directory), **options)

    def save(self, directory: str | Path) -> Path:
        """Write the model and tokenizer as a Hugging Face directory; returns it."""
        dest = Path(directory)
        dest.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(dest)
        self.tokenizer.save_pretrained(dest)
        return dest

    def forward(self, texts: Sequence[str], max_length: int) -> torch.Tensor:
        """Raw values of `texts` in one right-padded batch; gradients follow torch's grad mode."""
        import torch

        rows = [
            self.tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:]
            for text in texts
        ]
        width = max(len(ids) for ids in rows)
        pad = self.tokenizer.pad_token_id
        device = self.model.device
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in rows], device=device)
        attention_mask = torch.tensor(
            [[1] * len(ids) + [0] * (width - len(ids)) for ids in rows], device=device
        )
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]

    def values(self, texts: Sequence[str], max_length: int | None = None) -> list[float]:
        """Raw values of `texts`, `batch_size` at a time, in eval mode without gradients."""
        if self._on_torch_thread:
            return torch_thread.run(self._values, texts, max_length)
        return self._values(texts, max_length)

    def _values(self, texts: Sequence[str], max_length: int | None) -> list[float]:
        import torch

        was_training = self.model.training
        self.model.eval()
        values: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = texts[start : start + self.batch_size]
                values += self.forward(batch, max_length or self.max_length).tolist()
        self.model.train(was_training)
        return values

    def raw_scores(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """The linear head's outputs for (prompt, completion) pairs: what training compares."""
        texts = [
            ppm_input(self.tokenizer, prompt, completion)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        return self.values(texts)

    def score(self, prompts: Sequence[Prompt]) -> list[float]:
        """Scores in (-1, 1) as the reference uses them in search: `tanh(raw / 5)`
        (docs/rstar-math.md).

        A prompt is chat messages, rendered with the chat template (a final assistant message is
        continued, so [user, assistant] reads exactly as `ppm_input`), or a str scored as it is.
        """
        texts = [render_chat(self.tokenizer, p) if is_chat(p) else p for p in prompts]
        return [math.tanh(value / 5) for value in self.values(texts)]
