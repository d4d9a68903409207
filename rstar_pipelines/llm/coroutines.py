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
What a coroutine returns is ignored: coroutines keep their results in their own objects. A
coroutine given to `run_coroutines` is a root: it is done when it and every coroutine forked
from it (and from those) have ended, and `on_done` hears of it then, with its share of the wall
time (`Window`), so that a stage commits each root's result as soon as it is in.

How they are scheduled depends on the LLM:
- one that takes prompts one by one (`AsyncLLM`: the openai backend over a fleet of servers):
  nothing waits for anything else; a coroutine resumes as soon as its own answer is in, and
  its next Ask goes out at once, with its own max_tokens. The next root starts whenever the
  fleet has room (`types.spare_capacity`; the client wakes the scheduler when a window grows,
  `types.on_room`), so the client holds no more than the fleet runs;
  where the LLM reports no spare capacity, every root starts at once;
- one that only has `generate` (an in-process model, which runs one batch at a time anyway): in
  rounds, every coroutine advanced, then every Ask of the round submitted (stretched Asks in
  one batch at the largest max_tokens), every lane run, and all of it awaited. Which prompts
  share a batch is then fixed, so a seeded run reproduces (such a backend draws a batch's
  samples from one generator seeded per call).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any

from .types import LLM, AsyncLLM, Prompt, SamplingParams, on_room, spare_capacity, submit


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

# What the open roots of a stage (trees, chains of a problem, rollouts of a prompt) may hold, by
# default: the stages' `open_memory_mb`-style params.
OPEN_MEMORY_MB = 8192
# A generated token decodes to about 4 characters (Qwen2.5's tokenizer on English, maths and
# Python), one byte each in a Python str of such text.
BYTES_PER_TOKEN = 4


def memory_bound(root_bytes: int, memory_mb: float) -> int:
    """How many roots of at most `root_bytes` each may be open at once in `memory_mb` (at least
    one), so that a partition of any size holds no more than that budget."""
    if memory_mb <= 0:
        raise ValueError(f"the open roots need some memory, got memory_mb={memory_mb}")
    return max(1, int(memory_mb * 2**20) // root_bytes)


class Window:
    """Which of `count` items (trees, problems) run when: at most `size` at once (all of them,
    when None), the next one started as soon as one ends. And each item's share of the wall
    time: every moment split evenly among the items running then. Items that share one fleet
    overlap, so an item's own start-to-end time overstates its cost; the shares add up to the
    time anything ran, and an item that runs longer, or alone, gets more."""

    def __init__(self, count: int, size: int | None = None):
        if size is not None and size < 1:
            raise ValueError(f"a window holds at least one item, got size {size}")
        self.count, self.size = count, size or count
        self._next = 0
        self._running: dict[int, float] = {}  # item -> the clock when it started
        self._clock = 0.0  # seconds per running item, summed since the first start
        self._last = time.perf_counter()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def has_room(self) -> bool:
        """Whether an item is left to start and the window has room for it."""
        return not self.all_started and len(self._running) < self.size

    @property
    def all_started(self) -> bool:
        return self._next >= self.count

    @property
    def left(self) -> int:
        """The items not yet started."""
        return self.count - self._next

    def start(self, at_most: int | None = None) -> list[int]:
        """The items to start now, in order: as many as the window has room for, at most
        `at_most` (None: no limit)."""
        self._advance()
        started = []
        while self.has_room and (at_most is None or len(started) < at_most):
            self._running[self._next] = self._clock
            started.append(self._next)
            self._next += 1
        return started

    def end(self, item: int) -> float:
        """`item` has ended: its share of the wall time, in seconds."""
        self._advance()
        return self._clock - self._running.pop(item)

    def _advance(self) -> None:
        now = time.perf_counter()
        if self._running:
            self._clock += (now - self._last) / len(self._running)
        self._last = now


class Arrivals:
    """The futures a scheduler waits for, handed back as they finish. Each puts itself on a
    queue when it is done, so that a wait costs per future finished, not per future in flight
    (`concurrent.futures.wait` visits every one on each call: thousands over a large fleet).
    `wake` ends a wait with nothing finished: the fleet has room for more work; between
    `wake_on_room(llm)` and `stop_waking()` the LLM's client calls it (`types.on_room`)."""

    def __init__(self) -> None:
        self._finished: SimpleQueue[Future | None] = SimpleQueue()
        self._stop_waking: Callable[[], None] | None = None

    def watch(self, future: Future) -> None:
        future.add_done_callback(self._finished.put)

    def wake(self) -> None:
        self._finished.put(None)

    def wake_on_room(self, llm: LLM) -> None:
        self._stop_waking = on_room(llm, self.wake)

    def stop_waking(self) -> None:
        """No more wakes for room (the caller has nothing left to open); once is enough."""
        if self._stop_waking is not None:
            self._stop_waking()
            self._stop_waking = None

    def wait(self, timeout: float | None) -> list[Future]:
        """The futures watched that finished since the last call, waiting up to `timeout`
        seconds (None: as long as it takes) for the first or a wake; [] if none finished."""
        try:
            arrived = [self._finished.get(timeout=timeout)]
        except Empty:
            return []
        while not self._finished.empty():
            arrived.append(self._finished.get())
        return [future for future in arrived if future is not None]


def run_coroutines(
    llm: LLM,
    coroutines: Sequence[Coroutine],
    lanes: dict[str, Callable[[list[Any]], list[Any]]] | None = None,
    on_done: Callable[[int, float], None] | None = None,
    window: int | None = None,
) -> None:
    """Run every coroutine to its end (see the module docstring); `on_done(i, seconds)` as soon
    as root `i` and its forks have ended, called from this thread. Roots start as the LLM has
    room for them: over a fleet that reports its spare capacity (`types.spare_capacity`), the
    next root whenever its windows have room; else every root at once. At most `window` roots
    run at once where it is given."""
    _Scheduler(llm, lanes or {}, on_done, window).run(coroutines)


class _Scheduler:
    def __init__(
        self,
        llm: LLM,
        lanes: dict[str, Callable[[list[Any]], list[Any]]],
        on_done: Callable[[int, float], None] | None = None,
        most_open: int | None = None,
    ):
        self.llm, self.lanes, self.on_done, self.most_open = llm, lanes, on_done, most_open
        self.streamed = isinstance(llm, AsyncLLM)
        self.root: dict[Coroutine, int] = {}  # every live coroutine's root
        self.alive: dict[int, int] = {}  # root -> its live coroutines
        self.window: Window | None = None
        self.ready: deque[tuple[Coroutine, Any]] = deque()
        self.asks: list[tuple[Coroutine, Ask]] = []
        self.batches: dict[str, list[tuple[Coroutine, Sequence[Any]]]] = defaultdict(list)
        # future -> (lane, or None for an Ask; the coroutines and their items)
        self.waiting: dict[Future, tuple[str | None, list[tuple[Coroutine, Sequence[Any]]]]] = {}
        self.arrivals = Arrivals()  # what of `waiting` is in, when streamed

    def run(self, coroutines: Sequence[Coroutine]) -> None:
        self.window = Window(len(coroutines), self.most_open)
        if self.streamed:
            self.arrivals.wake_on_room(self.llm)
        with ThreadPoolExecutor(max_workers=max(1, len(self.lanes))) as pool:
            try:
                while True:
                    self._open(coroutines)
                    if self.window.all_started:
                        self.arrivals.stop_waking()
                    self._advance()
                    self._submit_asks()
                    busy = {lane for lane, _ in self.waiting.values() if lane is not None}
                    for lane in [lane for lane in self.batches if lane not in busy]:
                        entries = self.batches.pop(lane)
                        items = [item for _, group in entries for item in group]
                        self._await(pool.submit(self.lanes[lane], items), lane, entries)
                    if self.window.has_room and self._to_open() != 0:
                        continue  # the fleet has room for another root
                    if not self.waiting:
                        break
                    if self.streamed:  # what is in, or nothing when the fleet has room
                        done = self.arrivals.wait(None)
                    else:  # a round: all of it, resumed in the order it was asked
                        wait(self.waiting)
                        done = list(self.waiting)
                    for future in done:
                        self._resume(future)
            finally:
                self.arrivals.stop_waking()
                for future in self.waiting:
                    future.cancel()

    def _await(
        self, future: Future, lane: str | None, entries: list[tuple[Coroutine, Sequence[Any]]]
    ) -> None:
        """`entries`' coroutines wait for `future`: a lane's batch, or an Ask (lane None)."""
        self.waiting[future] = (lane, entries)
        if self.streamed:
            self.arrivals.watch(future)

    def _open(self, coroutines: Sequence[Coroutine]) -> None:
        for i in self.window.start(self._to_open()):
            self.root[coroutines[i]] = i
            self.alive[i] = 1
            self.ready.append((coroutines[i], None))

    def _to_open(self) -> int | None:
        """How many more roots to start now (None: as many as the window has room for). Over
        an `AsyncLLM` that reports its spare capacity (a fleet), one while it has room, or when
        none is running; in rounds, and over an LLM that reports none, every root at once."""
        spare = spare_capacity(self.llm) if self.streamed else None
        if spare is None:
            return None
        return 1 if spare > 0 or self.window.running == 0 else 0

    def _advance(self) -> None:
        while self.ready:
            coroutine, reply = self.ready.popleft()
            try:
                request = coroutine.send(reply)
            except StopIteration:
                self._ended(coroutine, forked=())
                continue
            if isinstance(request, Ask):
                self.asks.append((coroutine, request))
            elif isinstance(request, Batch):
                if request.lane not in self.lanes:
                    raise ValueError(f"no lane {request.lane!r} to run a batch on")
                self.batches[request.lane].append((coroutine, request.items))
            elif isinstance(request, Fork):
                self.ready.extend((c, None) for c in request.coroutines)
                self._ended(coroutine, forked=request.coroutines)
            else:
                raise TypeError(f"a coroutine yielded {request!r}")

    def _ended(self, coroutine: Coroutine, forked: Sequence[Coroutine]) -> None:
        root = self.root.pop(coroutine)
        for child in forked:
            self.root[child] = root
        self.alive[root] += len(forked) - 1
        if self.alive[root] == 0:
            del self.alive[root]
            seconds = self.window.end(root)
            if self.on_done is not None:
                self.on_done(root, seconds)

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
                self._await(future, None, [(coroutine, ())])

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
