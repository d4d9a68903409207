"""How many sequences a server of the fleet gets in flight: a window that finds the server's
capacity instead of being told it (docs/llm-serving.md, "The window").

The window starts small and grows while the server decodes everything it is sent; it settles
where a small queue stands at the server (a quarter of what it runs, at least 2), so a slot that
frees always finds a sequence waiting, and the queue does not grow beyond that. It is a gradient
limiter in the family of TCP Vegas and Netflix's concurrency-limits, over the engine's own load
where the engine reports it:

- vLLM, SGLang, TGI and llama.cpp (`--metrics`) report requests running and waiting on
  Prometheus `/metrics`; a llama.cpp server's `/slots` lists its slots and which are busy
  (`load_from_metrics`, `load_from_slots`).
- Elsewhere the queue is read from the answers: tokens decoded per second a sequence spends in
  flight is the server's decode speed while nothing queues, and falls as sequences wait; its
  ratio to the best seen is the share of the window the server is decoding.

Decisions are made once per round trip: only answers to requests sent since the last decision
count, as in TCP's congestion control, so a change is judged by its own effect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

START = 16  # requests in flight before the server has shown a queue
POLL_S = 0.25  # how often a server that reports its load is asked for it
# ... until its first sign of a queue: the doubling then takes a fifth of the time it would, the
# start being what a window costs against one declared at the server's capacity.
RAMP_POLL_S = 0.05
QUEUE_SHARE = 0.25  # the standing queue aimed at, as a share of what the server runs
MIN_QUEUE = 2
# Without load reports: the share of the window decoding below which sequences are taken to
# queue. Under 1 because the decode speed read from a round's answers is noisy.
DECODING_BELOW = 0.8
# The best decode speed seen is forgotten slowly, so that a server slowed for good (shared with
# other clients, or restarted on smaller hardware) is not taken to be queueing forever.
BEST_DECAY = 0.98
MIN_ROUND_REQUESTS = 8
MIN_ROUND_SEQUENCES = 16
GROWTH = 1 / 8  # after the first sign of a queue: per report or round that shows none

# Gauges of sequences running and waiting, by engine (their `/metrics` names).
RUNNING_GAUGES = (
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "tgi_batch_current_size",
    "llamacpp:requests_processing",
)
WAITING_GAUGES = (
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "tgi_queue_size",
    "llamacpp:requests_deferred",
)


@dataclass(frozen=True)
class Load:
    """What a server reports it is doing: sequences decoding and sequences queued."""

    running: float
    waiting: float


def load_from_metrics(text: str) -> Load | None:
    """Running and waiting sequences from a Prometheus `/metrics` page (summed over the models
    and engines it lists); None when it has no gauge this module knows."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    running = [values[name] for name in RUNNING_GAUGES if name in values]
    waiting = [values[name] for name in WAITING_GAUGES if name in values]
    if not running or not waiting:
        return None
    return Load(running[0], waiting[0])


def load_from_slots(slots: Iterable[dict], in_flight: int) -> Load:
    """A llama.cpp server's load from `/slots`: the busy slots run, and what this client has in
    flight beyond the slots waits (llama.cpp does not report its queue there)."""
    slots = list(slots)
    busy = sum(bool(s.get("is_processing", s.get("state", 0))) for s in slots)
    return Load(float(busy), float(max(0, in_flight - len(slots))))


class AdaptiveWindow:
    """The most sequences one server gets in flight (`limit`), found from its answers and load.

    Call `sent` as a request goes out (it returns the round to hand back), `answered` when its
    answer is in. A server that reports its load: call `observe` with it every `poll_s` while
    it has work. Any other: call `decide` when `answered` returns True. `overloaded` on a
    429/503 with Retry-After, `failed` on a connection error or timeout.

    It starts at `START` requests' worth of sequences. Until the first sign of a queue it
    doubles: each report that shows none, or (without reports) by the sequences of each answer,
    which doubles it every round trip as TCP's slow start does; after that sign it grows by an
    eighth each report or round with no queue. A request of n samples is held until its last
    sample ends, so its decode speed per sequence in flight is lower the more samples it has,
    whatever the load: speeds are compared per request size.
    """

    def __init__(self, cap: int | None = None, reports_load: bool = False):
        self.cap = cap
        self.reports_load = reports_load
        self.limit = self._capped(START)
        self.growing_fast = True
        self.best: dict[int, float] = {}  # by request size: most tokens/s per sequence in flight
        self.round = 0
        self._recovering_to: int | None = None
        self._size = 1  # samples of the latest request
        self._new_round()

    @property
    def poll_s(self) -> float:
        """How long until the server's load should be read again."""
        return RAMP_POLL_S if self.growing_fast else POLL_S

    def _new_round(self) -> None:
        self.round += 1
        self._tokens: dict[int, float] = {}
        self._sequence_s: dict[int, float] = {}
        self._requests = self._sequences = 0
        # answered sequences a round needs at least: half a window, so its speed is not noise
        self._round_sequences = max(MIN_ROUND_SEQUENCES, self.limit // 2)
        self._full = False
        self._sent = self._in_flight_sum = 0

    def _capped(self, limit: float) -> int:
        limit = max(1, math.ceil(limit))
        return min(limit, self.cap) if self.cap else limit

    def sent(self, in_flight: int, size: int) -> int:
        """A request of `size` samples went out; `in_flight` counts the sequences in flight
        with it. The round to pass back."""
        if self.growing_fast:
            self.limit = max(self.limit, self._capped(START * size))
        self._sent += 1
        self._in_flight_sum += in_flight
        self._size = size
        self._full = self._full or in_flight + size > self.limit  # the next would not fit
        return self.round

    def answered(self, sent_in: int, sequences: int, tokens: int, latency_s: float) -> bool:
        """Record an answer to a request of `sequences` samples sent in round `sent_in`; True
        when this round has enough answers to decide on."""
        if self._recovering_to is not None:  # back to where it was, doubling per answer
            self.limit = min(self._recovering_to, self.limit * 2)
            if self.limit == self._recovering_to:
                self._recovering_to = None
            return False
        if self.growing_fast and self._full and not self.reports_load:
            self.limit = self._capped(self.limit + sequences)
        if sent_in != self.round:
            return False
        self._requests += 1
        self._sequences += sequences
        self._tokens[sequences] = self._tokens.get(sequences, 0.0) + tokens
        seconds = sequences * max(latency_s, 1e-6)
        self._sequence_s[sequences] = self._sequence_s.get(sequences, 0.0) + seconds
        enough = self._requests >= MIN_ROUND_REQUESTS and self._sequences >= self._round_sequences
        return enough and not self.reports_load

    def decoding(self) -> float:
        """The share of this round's sequence-seconds in flight the server spent decoding: its
        decode speed against the best seen for requests of the same size."""
        weighted = 0.0
        for size, seconds in self._sequence_s.items():
            speed = self._tokens[size] / seconds
            self.best[size] = max(speed, self.best.get(size, 0.0) * BEST_DECAY)
            weighted += seconds * speed / self.best[size]
        total = sum(self._sequence_s.values())
        return weighted / total if total else 1.0

    def decide(self) -> None:
        """End a round of answers (a server that does not report its load): hold the window,
        grow it, or shrink it to what the server decodes plus the standing queue."""
        decoding = self.decoding()
        if decoding < DECODING_BELOW:
            in_flight = self._in_flight_sum / self._sent if self._sent else self.limit
            self._shrink(in_flight * decoding * (1 + QUEUE_SHARE))
        else:
            self._grow()
        self._new_round()

    def observe(self, load: Load, in_flight: int) -> None:
        """The server's load, with `in_flight` sequences of ours there: the window shrinks to
        what is in flight less the queue beyond the standing one (measured from what is in
        flight, so reports that follow before the queue drains ask for no more), or grows. A
        window that is full now counts as full though nothing was sent since the last report:
        with several samples a request, answers (and room) come seldom while the server's
        queue drains."""
        self._full = self._full or in_flight + self._size > self.limit
        allowance = max(MIN_QUEUE, QUEUE_SHARE * load.running)
        if load.waiting > allowance:
            self.growing_fast = False
            self.limit = self._capped(min(self.limit, in_flight - (load.waiting - allowance)))
        else:
            self._grow()
        self._new_round()

    def _shrink(self, target: float) -> None:
        """Down to `target`, by a quarter at most: the speeds a round reads are noisy."""
        self.growing_fast = False
        self.limit = self._capped(max(self.limit * 0.75, target))

    def _grow(self) -> None:
        """Grow if the window was full (more work waited for it)."""
        if not self._full:
            return
        if not self.growing_fast:
            self.limit = self._capped(self.limit * (1 + GROWTH))
        elif self.reports_load:
            self.limit = self._capped(self.limit * 2)

    def overloaded(self) -> None:
        """The server asked for time (429 or 503 with Retry-After): half the window."""
        self.growing_fast = False
        self._recovering_to = None
        self.limit = self._capped(self.limit / 2)
        self._new_round()

    def failed(self) -> None:
        """The server did not answer: one sequence at a time until it does, then back to the
        window it had, doubling per answer."""
        if self._recovering_to is None:
            self._recovering_to = self.limit
        self.limit = 1
        self._new_round()
