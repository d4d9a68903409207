"""The fleet client's spare capacity (`OpenAILLM.spare_capacity`, `llm.types.spare_capacity`):
the room left in its windows less what waits to be sent, so that a caller opening work while it
is above 0 keeps a fleet full without being told its size."""

from __future__ import annotations

import threading
import time
from contextlib import closing

from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.llm.coroutines import Ask, run_coroutines
from rstar_pipelines.llm.counting import CountingLLM
from rstar_pipelines.llm.fleet_window import START
from rstar_pipelines.llm.types import on_room, spare_capacity
from tests.fakes.llm import CapacityFleet, ScriptedLLM
from tests.fakes.servers import wait_until
from tests.fakes.simulated_engines import fleet

TICK_S = 0.02
CAPACITY = 32
PARAMS = SamplingParams(n=1, temperature=0.8, max_tokens=64, seed=0)


def test_what_is_submitted_takes_the_room_and_answers_give_it_back():
    with (
        fleet([("vllm", CAPACITY)], TICK_S) as [url],
        closing(load_llm("openai", base_url=url)) as llm,
    ):
        assert spare_capacity(CountingLLM(llm)) == START  # a server not yet asked: its first window
        # One sample a prompt: a request of n samples opens the window at n x START when it
        # goes, which may be before the next line or after it.
        futures = llm.submit([f"p{i}" for i in range(10)], PARAMS)
        assert llm.spare_capacity() == START - 10  # counted as soon as submitted, sent or not
        for future in futures:
            future.result(timeout=60)
        [stats] = llm.server_stats().values()
        assert llm.spare_capacity() == stats["window"]  # nothing in flight or waiting


def test_opening_work_while_there_is_room_fills_the_server():
    """A caller that submits a prompt whenever the client has room, as the search opens trees:
    the window grows to the server's capacity and the server stays full."""
    with (
        fleet([("vllm", CAPACITY)], TICK_S) as [url],
        closing(load_llm("openai", base_url=url)) as llm,
    ):
        futures = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            if llm.spare_capacity() > 0:
                futures += llm.submit([f"p{len(futures)}"], PARAMS)
            else:
                time.sleep(0.005)
        [stats] = llm.server_stats().values()
        for future in futures:
            future.cancel()
    assert CAPACITY <= stats["window"] <= 2 * CAPACITY, stats
    assert stats["in_flight"] >= CAPACITY  # the server full, and a queue standing at it


def test_a_model_in_process_reports_no_spare_capacity():
    assert spare_capacity(ScriptedLLM(lambda prompt, params: ["x"])) is None


def _most_running(llm, roots: int, window: int | None = None) -> int:
    """The most of `roots` coroutines (each asks for two samples, twice) running at once."""
    running, most = [0], [0]

    def root(i: int):
        running[0] += 1
        most[0] = max(most[0], running[0])
        yield Ask(f"p{i}", PARAMS.model_copy(update={"n": 2}))
        yield Ask(f"p{i}+", PARAMS.model_copy(update={"n": 2}))
        running[0] -= 1

    run_coroutines(llm, [root(i) for i in range(roots)], window=window)
    return most[0]


def test_coroutines_start_as_the_fleet_has_room():
    scripted = ScriptedLLM(lambda prompt, params: ["a", "b"])
    fleet = {c: CapacityFleet(scripted, c, delay_s=0.01) for c in (2, 8, 1000)}
    most = {c: _most_running(llm, 30) for c, llm in fleet.items()}
    # Two slots hold one root's Ask of two samples: about one root at a time (one more may open
    # in the moment an answer has freed the room and its root has not yet asked again).
    assert most[2] < most[8] < most[1000] == 30  # room for all: every root at once
    assert _most_running(fleet[1000], 30, window=5) == 5  # a declared window caps it
    assert _most_running(scripted, 30) == 30  # in process: every root at once


def test_the_client_says_when_its_window_grows_before_any_answer():
    """A caller waiting for answers to open more work is woken when the window grows (the
    server's load shows room), not when the first answer comes back: with long sequences that
    may be minutes. Once stopped, it hears no more."""
    woken = threading.Event()
    long = PARAMS.model_copy(update={"max_tokens": 100_000})  # nothing answers during the test
    with (
        fleet([("vllm", CAPACITY)], TICK_S) as [url],
        closing(load_llm("openai", base_url=url)) as llm,
    ):
        stop = on_room(CountingLLM(llm), woken.set)
        futures = llm.submit([f"p{i}" for i in range(START)], long)
        assert llm.spare_capacity() <= 0
        woken.clear()
        assert woken.wait(timeout=10)  # the window grew: room, and a call to say so
        assert llm.spare_capacity() > 0 and not any(f.done() for f in futures)
        stop()
        futures += llm.submit([f"q{i}" for i in range(llm.spare_capacity())], long)
        woken.clear()
        deadline = time.monotonic() + 10
        while llm.spare_capacity() <= 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.spare_capacity() > 0  # the window grew again ...
        assert not woken.wait(timeout=0.5)  # ... and no one was told
        for future in futures:
            future.cancel()


def test_coroutines_start_when_the_fleet_grows_before_any_answer():
    held = threading.Event()  # no answer until the roots have started
    scripted = ScriptedLLM(lambda prompt, params: ["a", "b"])
    llm = CapacityFleet(scripted, 2, delay_s=0.0, held=held)
    started = []

    def root(i: int):
        started.append(i)
        yield Ask(f"p{i}", PARAMS.model_copy(update={"n": 2}))

    runner = threading.Thread(target=run_coroutines, args=(llm, [root(i) for i in range(4)]))
    runner.start()
    try:
        wait_until(lambda: len(started) == 1, "the first root", 10)
        llm.grow(8)  # room for every root, and still no answer
        wait_until(lambda: len(started) == 4, "every root", 10)
    finally:
        held.set()
        runner.join()
