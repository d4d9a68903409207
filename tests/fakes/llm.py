"""Scripted LLMs: the `LLM` protocol (`name`, `generate`, `batch_size`), `AsyncLLM`'s `submit`,
and the `llm` resource over them, answering from scripts so every completion is known."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import ClassVar

from rstar_pipelines.llm import LLM, TRANSFORMERS_REVISION, Completion, Prompt, SamplingParams
from rstar_pipelines.llm.coroutines import Arrivals
from rstar_pipelines.llm.resource import LLMResource

# How the transformers backend's model ids begin: its name and revision.
TRANSFORMERS = f"transformers@{TRANSFORMERS_REVISION}"

Reply = Callable[[Prompt, SamplingParams], Sequence[str | Completion]]


def completion(
    text: str,
    *,
    stops: Sequence[str] = (),
    tokens: int | None = None,
    prompt_tokens: int = 10,
    max_tokens: int | None = None,
) -> Completion:
    """`text` as a model returns it: a trailing stop string of `stops` is cut off and reported
    ("stop"), else it ended at EOS. `tokens` completion tokens, or one per character of `text`
    (its stop string included) when None; past `max_tokens` characters it is cut there
    ("length"), as a model's would be."""
    if max_tokens is not None and len(text) > max_tokens:
        return Completion(text[:max_tokens], "length", None, prompt_tokens, max_tokens)
    count = len(text) if tokens is None else tokens
    for stop in stops:
        if text.endswith(stop):
            return Completion(text[: -len(stop)], "stop", stop, prompt_tokens, count)
    return Completion(text, "eos", None, prompt_tokens, count)


class ScriptedLLM:
    """An LLM whose completions for a prompt are `reply(prompt, params)`: texts (made into
    completions by `completion` with `stops`, `tokens`, `prompt_tokens`, and `max_tokens` when
    `truncate`) or completions. With `cycle` each prompt gets exactly `params.n`, the scripted
    ones repeated in turn; else all the scripted ones, whatever `n` asks.

    Every `generate` call is recorded in `calls` as (prompts, params); `generated` sums the
    completion tokens it returned. Clearing `hold` keeps a call waiting inside `generate`
    until it is set again (at most 10 s)."""

    def __init__(
        self,
        reply: Reply | None = None,
        *,
        name: str = "scripted",
        cycle: bool = False,
        stops: Sequence[str] = (),
        tokens: int | None = None,
        prompt_tokens: int = 10,
        truncate: bool = False,
        batch_size: int | None = None,
    ):
        if reply is not None:
            self.reply = reply
        self.name = name
        self.cycle, self.stops, self.tokens = cycle, tuple(stops), tokens
        self.prompt_tokens, self.truncate = prompt_tokens, truncate
        if batch_size is not None:
            self.batch_size = batch_size
        self.calls: list[tuple[list[Prompt], SamplingParams]] = []
        self.generated = 0
        self.hold = threading.Event()
        self.hold.set()

    def reply(self, prompt: Prompt, params: SamplingParams) -> Sequence[str | Completion]:
        raise NotImplementedError(f"{type(self).__name__} has no script: pass reply=")

    @property
    def prompts(self) -> int:
        """Prompts asked so far, over every call."""
        return sum(len(prompts) for prompts, _ in self.calls)

    @property
    def batches(self) -> list[int]:
        """The number of prompts of each `generate` call."""
        return [len(prompts) for prompts, _ in self.calls]

    def completions(self, prompt: Prompt, params: SamplingParams) -> list[Completion]:
        scripted = [self._complete(r, params) for r in self.reply(prompt, params)]
        if self.cycle:
            return [scripted[i % len(scripted)] for i in range(params.n)]
        return scripted

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((list(prompts), params))
        self.hold.wait(10)
        out = [self.completions(prompt, params) for prompt in prompts]
        self.generated += sum(c.completion_tokens for cs in out for c in cs)
        return out

    def _complete(self, reply: str | Completion, params: SamplingParams) -> Completion:
        if isinstance(reply, Completion):
            return reply
        max_tokens = params.max_tokens if self.truncate else None
        return completion(
            reply,
            stops=self.stops,
            tokens=self.tokens,
            prompt_tokens=self.prompt_tokens,
            max_tokens=max_tokens,
        )


def fleet_answer(
    llm: ScriptedLLM, asked: Counter[str], prompt: Prompt, params: SamplingParams
) -> tuple[list[Completion], int]:
    """What a fleet of servers answers `prompt` with, and its place: asked one sample at a time
    (n=1), the k-th ask (counted in `asked`) gets the k-th of its scripted completions
    (cycled) and k; asked for more, all of them and the last one's place."""
    result = llm.completions(prompt, params)
    if params.n != 1:
        return result, len(result) - 1
    k = asked[str(prompt)] % len(result)
    asked[str(prompt)] += 1
    return [result[k]], k


class StreamingLLM:
    """A scripted LLM as a fleet of servers answers it (an `AsyncLLM`): a future per prompt.
    Asked one sample at a time (n=1), the k-th ask for a prompt gets the k-th of its scripted
    completions (cycled), `delay_s * k` seconds later; asked for more, all of them after
    `delay_s` times one less than their number. `generate` is the scripted LLM's."""

    def __init__(self, llm: ScriptedLLM, delay_s: float):
        self.llm, self.delay_s = llm, delay_s
        self.name = llm.name
        self.asked: Counter[str] = Counter()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        return self.llm.generate(prompts, params)

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
    ) -> list[Future[list[Completion]]]:
        futures = []
        for prompt in prompts:
            result, k = fleet_answer(self.llm, self.asked, prompt, params)
            future: Future = Future()
            threading.Timer(
                self.delay_s * k, lambda f=future, r=result: f.cancelled() or f.set_result(r)
            ).start()
            futures.append(future)
        return futures


class ArrivingLLM:
    """A scripted LLM as a fleet of servers answers it (an `AsyncLLM`), each sample a request
    of its own (n=1): the k-th ask for a prompt gets the k-th of its scripted completions. A
    sample arrives only when the search waits for it (`arrivals`, put in the search module's
    place), and `order(n)` picks how many of the n - 1 samples after it in its expansion arrive
    with it. That is every order an expansion's samples can arrive in, as far
    as the search can tell: it reads its samples in order, and on each one it reads, whether
    the ones right after it are in already (`EveryOrder` plays them all)."""

    def __init__(self, llm: ScriptedLLM, order: Callable[[int], int]):
        self.llm, self.order = llm, order
        self.name = llm.name
        self.asked: Counter[str] = Counter()
        self.coming: dict[Future, list[Completion]] = {}
        self.samples: dict[str, list[Future]] = {}  # a prompt's samples, in order
        self.prompt_of: dict[Future, str] = {}

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        return self.llm.generate(prompts, params)

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
    ) -> list[Future[list[Completion]]]:
        futures = []
        for prompt in prompts:
            result, _ = fleet_answer(self.llm, self.asked, prompt, params)
            future: Future = Future()
            self.coming[future] = result
            self.samples.setdefault(prompt, []).append(future)
            self.prompt_of[future] = prompt
            futures.append(future)
        return futures

    def arrivals(self) -> Arrivals:
        """The search's `mcts.Arrivals`: when nothing the search waits for is in, the first
        sample it began to wait for arrives, with `order(n)` of the n - 1 after it."""
        return _ArrivalsInOrder(self)

    def arrive(self, first: Future) -> None:
        samples = self.samples[self.prompt_of[first]]
        after = samples[samples.index(first) + 1 :]
        after = after[: next((i for i, f in enumerate(after) if f not in self.coming), None)]
        for future in [first, *after[: self.order(len(after) + 1)]]:
            future.set_result(self.coming.pop(future))


class _ArrivalsInOrder(Arrivals):
    def __init__(self, llm: ArrivingLLM):
        super().__init__()
        self.llm = llm
        self.watched: list[Future] = []  # in the order the search began to wait for them

    def watch(self, future: Future) -> None:
        self.watched.append(future)
        super().watch(future)

    def wait(self, timeout: float | None) -> list[Future]:
        watched, coming = self.watched, self.llm.coming
        if watched and not any(f.done() for f in watched) and all(f in coming for f in watched):
            self.llm.arrive(watched[0])
        finished = super().wait(timeout)
        self.watched = [f for f in watched if f not in finished]
        return finished


class CapacityFleet:
    """A scripted LLM as a fleet of `capacity` slots answers it (an `AsyncLLM` that reports
    its spare capacity), with `fleet_answer`'s completions; each answer comes after a delay drawn
    from `seed` (up to `delay_s`), so samples arrive out of order. `spare_capacity()` is the
    slots less the sequences not yet answered; the test sets `capacity`, or `grow`s it as a
    client's window grows, calling what `on_room` was given; `sent` records what was asked for,
    with its priority. With `held`, answers wait until it is set. A prompt whose script lacks
    it fails its future (KeyError), as a crashed server would."""

    def __init__(
        self,
        llm: ScriptedLLM,
        capacity: int,
        delay_s: float = 0.02,
        seed: int = 0,
        held: threading.Event | None = None,
    ):
        self.llm, self.capacity, self.delay_s, self.held = llm, capacity, delay_s, held
        self.name = llm.name
        self.random = random.Random(seed)
        self.asked: Counter[str] = Counter()
        self.sent: list[tuple[Prompt, float]] = []  # each prompt asked for, with its priority
        self.outstanding = 0
        self.lock = threading.Lock()
        self.room_callbacks: list[Callable[[], None]] = []

    def on_room(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.room_callbacks.append(callback)

        def stop() -> None:
            if callback in self.room_callbacks:
                self.room_callbacks.remove(callback)

        return stop

    def grow(self, capacity: int) -> None:
        with self.lock:
            self.capacity = capacity
        for callback in list(self.room_callbacks):
            callback()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        return [future.result() for future in self.submit(prompts, params)]

    def spare_capacity(self) -> int:
        with self.lock:
            return self.capacity - self.outstanding

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
    ) -> list[Future[list[Completion]]]:
        futures = []
        for prompt in prompts:
            future: Future = Future()
            futures.append(future)
            with self.lock:  # searches side by side submit from threads of their own
                self.sent.append((prompt, priority))
                try:
                    result, _ = fleet_answer(self.llm, self.asked, prompt, params)
                except KeyError as exc:
                    future.set_exception(exc)
                    continue
                self.outstanding += params.n
                delay_s = self.random.uniform(0, self.delay_s)
            threading.Timer(delay_s, self._answer, (future, result, params.n)).start()
        return futures

    def _answer(self, future: Future, result: list[Completion], n: int) -> None:
        if self.held is not None:
            self.held.wait()
        with self.lock:
            self.outstanding -= n
        if not future.cancelled():
            future.set_result(result)


class EveryOrder:
    """The choices of an `ArrivingLLM`, run after run, until every sequence of them is
    played (depth first): `next()` moves on to the next one, False when none is left."""

    def __init__(self):
        self.prefix: list[int] = []
        self.played: list[tuple[int, int]] = []  # (choice, options) of this run

    def __call__(self, options: int) -> int:
        at = len(self.played)
        choice = self.prefix[at] if at < len(self.prefix) else 0
        self.played.append((choice, options))
        return choice

    def next(self) -> bool:
        while self.played:
            choice, options = self.played.pop()
            if choice + 1 < options:
                self.prefix = [c for c, _ in self.played] + [choice + 1]
                self.played = []
                return True
        return False


class ScriptedLLMResource(LLMResource):
    """The `llm` resource answering with the scripted LLM registered under `script` (every
    model it is asked for). Dagster rebuilds resources from their fields, so the LLM is found by
    that key rather than held: `serving(llm)` registers one and returns its resource."""

    script: str
    registered: ClassVar[dict[str, LLM]] = {}

    @classmethod
    def serving(cls, llm: LLM, key: str | None = None) -> ScriptedLLMResource:
        key = key or f"{type(llm).__name__}-{id(llm):x}"
        cls.registered[key] = llm
        return cls(script=key)

    def get_llm(self, model: str | None = None) -> LLM:
        return self.registered[self.script]
