"""Many generator-coroutines over one LLM and batch lanes (a sandbox, a grader): the scheduler
behind DSER's chains and GRPO-RoC's rollouts.

A coroutine yields what it waits for and is resumed with the answer:
- `Ask(prompt, params)`: the prompt's `params.n` completions. The Asks pending together are
  submitted at once, grouped by params (`llm.types.submit`: one future per prompt). With
  `stretch`, an Ask may be sent with a larger max_tokens than its own, so that it shares a
  batch (the coroutine then holds its completion to its own limit).
- `Batch(lane, items)`: `lanes[lane](items)`'s results for the items. The items of every pending
  Batch of a lane go in one call, made in a worker thread when the lane is idle.
- `Fork(coroutines)`: the coroutine ends and these start.
What a coroutine returns is ignored: coroutines keep their results in their own objects.

How they are scheduled depends on the LLM:
- one that takes prompts one by one (`AsyncLLM`: the openai backend over a fleet of servers):
  nothing waits for anything else; a coroutine resumes as soon as its own answer is in, and
  its next Ask goes out at once, with its own max_tokens;
- one that only has `generate` (an in-process model, which runs one batch at a time anyway): in
  rounds, every coroutine advanced, then every Ask of the round submitted (stretched Asks in
  one batch at the largest max_tokens), every lane run, and all of it awaited. Which prompts
  share a batch is then fixed, so a seeded run reproduces (such a backend draws a batch's
  samples from one generator seeded per call).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from .types import LLM, AsyncLLM, Prompt, SamplingParams, submit


@dataclass(frozen=True)
class Ask:
    prompt: Prompt
    params: SamplingParams
    stretch: bool = False


@dataclass(frozen=True)
class Batch:
    lane: str
    items: Sequence[Any]


@dataclass(frozen=True)
class Fork:
    coroutines: Sequence[Generator]


Coroutine = Generator[Ask | Batch | Fork, Any, None]


def run_coroutines(
    llm: LLM,
    coroutines: Sequence[Coroutine],
    lanes: dict[str, Callable[[list[Any]], list[Any]]] | None = None,
) -> None:
    """Run every coroutine to its end (see the module docstring)."""
    _Scheduler(llm, lanes or {}).run(coroutines)


class _Scheduler:
    def __init__(self, llm: LLM, lanes: dict[str, Callable[[list[Any]], list[Any]]]):
        self.llm, self.lanes = llm, lanes
        self.streamed = isinstance(llm, AsyncLLM)
        self.ready: deque[tuple[Coroutine, Any]] = deque()
        self.asks: list[tuple[Coroutine, Ask]] = []
        self.batches: dict[str, list[tuple[Coroutine, Sequence[Any]]]] = defaultdict(list)
        # future -> (lane, or None for an Ask; the coroutines and their items)
        self.waiting: dict[Future, tuple[str | None, list[tuple[Coroutine, Sequence[Any]]]]] = {}

    def run(self, coroutines: Sequence[Coroutine]) -> None:
        self.ready.extend((c, None) for c in coroutines)
        with ThreadPoolExecutor(max_workers=max(1, len(self.lanes))) as pool:
            try:
                while self.ready or self.waiting:
                    self._advance()
                    self._submit_asks()
                    busy = {lane for lane, _ in self.waiting.values() if lane is not None}
                    for lane in [lane for lane in self.batches if lane not in busy]:
                        entries = self.batches.pop(lane)
                        items = [item for _, group in entries for item in group]
                        self.waiting[pool.submit(self.lanes[lane], items)] = (lane, entries)
                    if not self.waiting:
                        break
                    if self.streamed:
                        done, _ = wait(self.waiting, return_when=FIRST_COMPLETED)
                    else:  # a round: all of it, resumed in the order it was asked
                        wait(self.waiting)
                        done = list(self.waiting)
                    for future in done:
                        self._resume(future)
            finally:
                for future in self.waiting:
                    future.cancel()

    def _advance(self) -> None:
        while self.ready:
            coroutine, reply = self.ready.popleft()
            try:
                request = coroutine.send(reply)
            except StopIteration:
                continue
            if isinstance(request, Ask):
                self.asks.append((coroutine, request))
            elif isinstance(request, Batch):
                if request.lane not in self.lanes:
                    raise ValueError(f"no lane {request.lane!r} to run a batch on")
                self.batches[request.lane].append((coroutine, request.items))
            elif isinstance(request, Fork):
                self.ready.extend((c, None) for c in request.coroutines)
            else:
                raise TypeError(f"a coroutine yielded {request!r}")

    def _submit_asks(self) -> None:
        groups: dict[SamplingParams, list[tuple[Coroutine, Prompt]]] = defaultdict(list)
        stretched: dict[SamplingParams, list[tuple[Coroutine, Ask]]] = defaultdict(list)
        for coroutine, ask in self.asks:
            if ask.stretch and not self.streamed:
                stretched[ask.params.model_copy(update={"max_tokens": 1})].append((coroutine, ask))
            else:
                groups[ask.params].append((coroutine, ask.prompt))
        for entries in stretched.values():
            longest = max(ask.params.max_tokens for _, ask in entries)
            params = entries[0][1].params.model_copy(update={"max_tokens": longest})
            groups[params] += [(coroutine, ask.prompt) for coroutine, ask in entries]
        self.asks.clear()
        for params, entries in groups.items():
            futures = submit(self.llm, [prompt for _, prompt in entries], params)
            for future, (coroutine, _) in zip(futures, entries, strict=True):
                self.waiting[future] = (None, [(coroutine, ())])

    def _resume(self, future: Future) -> None:
        lane, entries = self.waiting.pop(future)
        result = future.result()
        if lane is None:
            self.ready.append((entries[0][0], result))
            return
        if len(result) != sum(len(group) for _, group in entries):
            raise RuntimeError(f"lane {lane!r} answered {len(result)} items")
        at = 0
        for coroutine, group in entries:
            self.ready.append((coroutine, list(result[at : at + len(group)])))
            at += len(group)
