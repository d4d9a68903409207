"""The types every LLM backend shares: sampling parameters, completions, prompts, the protocol,
and the asynchronous submission beside `generate` (`submit`, `stream`)."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

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
    counts every token the model generated, including the ones that made the stop string or EOS;
    `tokens_estimated` says it is an estimate (a server that counted only the tokens of all
    samples together: the openai backend splits that count across them).
    """

    text: str
    finish_reason: FinishReason
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens_estimated: bool = False


@runtime_checkable
class LLM(Protocol):
    """A model that completes prompts: a list of `params.n` completions per prompt, in order."""

    name: str

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[list[Completion]]: ...


@runtime_checkable
class AsyncLLM(LLM, Protocol):
    """An LLM that takes prompts one by one and answers each as soon as its completions are in
    (the openai backend over a fleet of servers). Others get `GenerateBatcher` from `submit`.
    What waits for the engine goes to it lowest `priority` first."""

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
    ) -> list[Future[list[Completion]]]: ...


def serves_each_request(llm: LLM) -> bool:
    """Whether `llm`'s own engine takes every request as it comes (AsyncLLM: a server fleet),
    looking through wrappers that pass `submit` on (`wrapped`, such as the progress counter).
    Over an in-process model `submit` goes through `GenerateBatcher`, which runs together only
    prompts with equal params: there many small requests cost many small batches."""
    while hasattr(llm, "wrapped"):
        llm = llm.wrapped
    return isinstance(llm, AsyncLLM)


def spare_capacity(llm: LLM) -> int | None:
    """How many more sequences `llm`'s engine would start now beyond what already waits for it
    (a fleet whose windows are not full: `OpenAILLM.spare_capacity`), looking through wrappers;
    at most 0 when it has all it can run. None where the LLM reports none: an in-process model
    runs what it is given a batch at a time, so more work open only fills its batches, and the
    caller's own bounds (memory, a declared window) decide how much is open."""
    while hasattr(llm, "wrapped"):
        llm = llm.wrapped
    spare = getattr(llm, "spare_capacity", None)
    return spare() if callable(spare) else None


def on_room(llm: LLM, callback: Callable[[], None]) -> Callable[[], None]:
    """Has `callback` called (from any thread) whenever `llm`'s spare capacity is above 0 with
    no answer coming back to say so: a fleet's window grew, a server came up
    (`OpenAILLM.on_room`). A caller that opens work as the fleet has room, and otherwise waits
    for its answers, wakes on it. Returns what stops the calls (once called, calling it again
    does nothing); nothing is called where the LLM reports no spare capacity."""
    while hasattr(llm, "wrapped"):
        llm = llm.wrapped
    watch = getattr(llm, "on_room", None)
    return watch(callback) if callable(watch) else _nothing_to_stop


def _nothing_to_stop() -> None:
    return None


def submit(
    llm: LLM, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
) -> list[Future[list[Completion]]]:
    """One future per prompt, resolved with its `params.n` completions as soon as they are in,
    whatever the others do. Cancelling a future that has not started withdraws its prompt.
    Over an `AsyncLLM`, prompts waiting for room go out lowest `priority` first; an in-process
    model runs everything waiting as its next batches, so there it changes nothing."""
    # An AsyncLLM is an LLM with `submit`. Asked by that method alone: a check against the
    # runtime protocol looks up each of its members, about 15 µs on every request of a search
    # that submits each sample alone.
    if callable(getattr(llm, "submit", None)):
        return llm.submit(prompts, params, priority)
    return GenerateBatcher.of(llm).submit(prompts, params)


def stream(
    llm: LLM, prompts: Sequence[Prompt], params: SamplingParams
) -> Iterator[tuple[int, list[Completion]]]:
    """(index, completions) for each prompt in the order they finish. On an error the prompts
    not yet started are withdrawn and the error is raised once the started ones have ended."""
    futures = submit(llm, prompts, params)
    index = {future: i for i, future in enumerate(futures)}
    pending = set(futures)
    try:
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield index[future], future.result()
    finally:
        for future in pending:
            future.cancel()


class GenerateBatcher:
    """`submit` for an LLM that has only `generate` (transformers, in-process vLLM, test
    fakes): one worker thread calls `generate` on what is waiting, the oldest prompt's params
    with every other prompt waiting with the same params, at most `max_batch` of them (the
    LLM's `batch_size` when it has one); prompts submitted meanwhile go in a later call. There
    is one batcher per LLM object, so callers on several threads share its batches and the
    model is never asked to generate twice at once. The thread ends when nothing waits."""

    DEFAULT_MAX_BATCH = 16
    _batchers: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, llm: LLM, max_batch: int | None = None):
        self.llm = llm
        self.max_batch = max_batch or getattr(llm, "batch_size", None) or self.DEFAULT_MAX_BATCH
        self._waiting: deque[tuple[Prompt, SamplingParams, Future]] = deque()
        self._cond = threading.Condition()
        self._working = False

    @classmethod
    def of(cls, llm: LLM) -> GenerateBatcher:
        with cls._lock:
            try:
                batcher = cls._batchers.get(llm)
            except TypeError:  # not weak-referenceable: a batcher of its own each time
                return cls(llm)
            if batcher is None:
                batcher = cls._batchers[llm] = cls(llm)
            return batcher

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[Future[list[Completion]]]:
        futures: list[Future[list[Completion]]] = [Future() for _ in prompts]
        with self._cond:
            self._waiting.extend(zip(prompts, [params] * len(futures), futures, strict=True))
            if not self._working and self._waiting:
                self._working = True
                threading.Thread(target=self._work, name="generate-batcher", daemon=True).start()
        return futures

    def _next_batch(self) -> tuple[SamplingParams, list[tuple[Prompt, Future]]] | None:
        with self._cond:
            while self._waiting and self._waiting[0][2].cancelled():
                self._waiting.popleft()
            if not self._waiting:
                self._working = False
                return None
            params = self._waiting[0][1]
            batch, rest = [], deque()
            for item in self._waiting:
                if item[1] == params and len(batch) < self.max_batch:
                    if item[2].set_running_or_notify_cancel():
                        batch.append((item[0], item[2]))
                else:
                    rest.append(item)
            self._waiting = rest
            return params, batch

    def _work(self) -> None:
        while (taken := self._next_batch()) is not None:
            params, batch = taken
            if not batch:
                continue
            try:
                outputs = self.llm.generate([prompt for prompt, _ in batch], params)
                if len(outputs) != len(batch):
                    raise RuntimeError(
                        f"LLM {self.llm.name!r} answered {len(outputs)} prompts of {len(batch)}"
                    )
            except BaseException as exc:  # the callers get the error, the worker goes on
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), completions in zip(batch, outputs, strict=True):
                future.set_result(completions)


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
