"""The types every LLM backend shares: sampling parameters, completions, prompts, the protocol."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

Message = Mapping[str, str]
# A str is raw text to continue; chat messages are rendered with the model's chat template.
Prompt = str | Sequence[Message]
FinishReason = Literal["stop", "length", "eos"]


class SamplingParams(BaseModel):
    """How to sample; the same meaning in every backend (vLLM's and OpenAI's names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(1, ge=1, description="completions per prompt")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_tokens: int = Field(256, ge=1, description="most tokens generated per completion")
    stop: tuple[str, ...] = Field(
        (), description="strings that end a completion; not part of its text"
    )
    seed: int | None = Field(
        None, ge=0, description="same seed, same prompts and options: same completions"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string_is_one_stop(cls, value: Any) -> Any:
        # A bare str is a Sequence too: without this it would become one stop per character.
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError(
                "stop strings must be non-empty (an empty one would match before any text)"
            )
        return value


@dataclass(frozen=True, slots=True)
class Completion:
    """One generated completion.

    `text` excludes the matched stop string (as vLLM and OpenAI return it). `completion_tokens`
    counts every token the model generated, including the ones that made the stop string or EOS.
    """

    text: str
    finish_reason: FinishReason
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int


@runtime_checkable
class LLM(Protocol):
    """A model that completes prompts: a list of `params.n` completions per prompt, in order."""

    name: str

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[list[Completion]]: ...


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """Cut `text` at the earliest occurrence of any stop string; return the rest and the match.

    Ties (two stop strings starting at the same place) go to the one listed first.
    """
    found = [(text.find(s), order, s) for order, s in enumerate(stop) if s in text]
    if not found:
        return text, None
    index, _, matched = min(found)
    return text[:index], matched


def is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str)


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> str:
    """Render chat messages with a Hugging Face tokenizer's chat template.

    A conversation that ends with an assistant message is continued (the model writes the rest of
    that message); otherwise a new assistant turn is opened.
    """
    messages = [dict(m) for m in messages]
    if not messages:
        raise ValueError("a chat prompt needs at least one message")
    continue_final = messages[-1].get("role") == "assistant"
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
    )
