"""An LLM wrapper that adds what each call produced to the running step's progress."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from rstar_pipelines import progress

from .types import Completion, submit


class CountingLLM:
    """An LLM that reports the completions and tokens of each `generate` call, and of each
    submitted prompt as it is answered."""

    def __init__(self, llm: Any):
        self._llm = llm

    def generate(self, prompts: Any, params: Any) -> Any:
        outputs = self._llm.generate(prompts, params)
        _count_completions([c for out in outputs for c in out])
        return outputs

    def submit(self, prompts: Any, params: Any, priority: float = 0.0) -> Any:
        futures = submit(self._llm, prompts, params, priority)
        for future in futures:
            future.add_done_callback(_count_answered)
        return futures

    @property
    def wrapped(self) -> Any:
        """The LLM whose calls this one counts."""
        return self._llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def _count_completions(completions: Sequence[Completion]) -> None:
    progress.count(
        completions=len(completions), tokens=sum(c.completion_tokens for c in completions)
    )


def _count_answered(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        _count_completions(future.result())
