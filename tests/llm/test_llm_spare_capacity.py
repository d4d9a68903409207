"""The fleet client's spare capacity (`OpenAILLM.spare_capacity`, `llm.types.spare_capacity`):
the room left in its windows less what waits to be sent, so that a caller opening work while it
is above 0 keeps a fleet full without being told its size."""

from __future__ import annotations

import time
from contextlib import closing

from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.llm.coroutines import Ask, run_coroutines
from rstar_pipelines.llm.counting import CountingLLM
from rstar_pipelines.llm.fleet_window import START
from rstar_pipelines.llm.types import spare_capacity
from tests.fakes.llm import CapacityFleet, ScriptedLLM
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
        futures = llm.submit([f"p{i}" for i in range(5)], PARAMS.model_copy(update={"n": 2}))
        assert llm.spare_capacity() <= START - 10  # counted as soon as submitted
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
