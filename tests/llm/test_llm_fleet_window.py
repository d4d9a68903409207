"""The window that finds each server's capacity (rstar_pipelines/llm/fleet_window.py): its rules
on plain numbers, and the openai backend over the simulated engines of
tests/fakes/simulated_engines.py (vLLM, usage only, ignores n, llama.cpp's few slots), each with
a capacity the client is not told.
"""

from __future__ import annotations

import time
from contextlib import closing

import httpx
import pytest

from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.llm.fleet_window import (
    START,
    AdaptiveWindow,
    Load,
    load_from_metrics,
    load_from_slots,
)
from rstar_pipelines.llm.openai_backend import split_count
from tests.fakes.simulated_engines import fleet, fleet_stats

TICK_S = 0.02
MAX_TOKENS = 64
CAPACITY = {"vllm": 48, "usage-only": 32, "ignores-n": 24, "llama.cpp": 4}


def test_a_reported_queue_shrinks_the_window_and_none_grows_it():
    window = AdaptiveWindow(reports_load=True)
    assert window.limit == START
    window.sent(in_flight=START, size=1)  # the window is full
    window.observe(Load(running=START, waiting=0), in_flight=START)
    assert window.limit == 2 * START  # no queue yet: doubling
    window.sent(in_flight=2 * START, size=1)
    window.observe(Load(running=20, waiting=12), in_flight=32)
    assert window.limit == 32 - (12 - 5)  # the queue beyond a quarter of what runs goes
    before = window.limit
    window.observe(Load(running=20, waiting=0), in_flight=10)  # not full: it holds
    assert window.limit == before


def test_a_window_full_of_held_samples_grows_without_a_request_sent():
    """Requests of 8 samples: a window full of answers still to come (most of their samples
    done, held until the last ends) grows while the server shows no queue, though no request
    went out since the last report (none could)."""
    window = AdaptiveWindow(reports_load=True)
    window.sent(in_flight=START * 8, size=8)
    window.observe(Load(running=100, waiting=40), in_flight=START * 8)  # a queue: no more doubling
    full = window.limit
    window.observe(Load(running=60, waiting=0), in_flight=full)  # nothing could be sent
    assert window.limit > full


def test_without_reports_it_grows_per_answer_then_backs_off_a_slower_round():
    window = AdaptiveWindow()
    round_ = window.sent(in_flight=START, size=1)
    ready = [window.answered(round_, 1, tokens=100, latency_s=1.0) for _ in range(16)]
    assert window.limit == START + 16  # slow start: one more per answered sequence
    assert ready[-1] and not any(ready[:-1])  # a round needs 16 sequences, or half a window
    window.decide()
    in_flight = window.limit
    round_ = window.sent(in_flight=in_flight, size=1)
    for _ in range(in_flight // 2):  # half the decode speed: half the window is queueing
        window.answered(round_, 1, tokens=100, latency_s=2.0)
    limit = window.limit
    window.decide()
    assert not window.growing_fast  # it shrinks to what decodes and a quarter, by 1/4 at most
    assert window.limit == max(round(0.75 * limit), round(in_flight * 0.5 * 1.25))


def test_failures_and_retry_after():
    window = AdaptiveWindow(cap=40)
    window.failed()
    assert window.limit == 1
    window.answered(window.round, 1, 10, 1.0)
    window.answered(window.round, 1, 10, 1.0)
    assert window.limit == 4  # back to where it was, doubling per answer
    for _ in range(3):
        window.answered(window.round, 1, 10, 1.0)
    assert window.limit == START
    window.overloaded()
    assert window.limit == START // 2 and not window.growing_fast
    assert AdaptiveWindow(cap=5).limit == 5


def test_load_reports():
    vllm = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a"} 12.0\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="a"} 4.0\n'
    )
    assert load_from_metrics(vllm) == Load(15.0, 4.0)
    sglang = "sglang:num_running_reqs 7\nsglang:num_queue_reqs 1\n"
    assert load_from_metrics(sglang) == Load(7.0, 1.0)
    assert load_from_metrics("process_cpu_seconds_total 3\n") is None
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]
    assert load_from_slots(slots, in_flight=5) == Load(1.0, 3.0)


def test_usage_split_adds_up():
    assert split_count(20, [2, 4]) == [8, 12]
    assert sum(split_count(101, [0, 7, 3, 50])) == 101
    assert split_count(3, [0, 0, 0]) == [1, 1, 1]


def _prompts(count: int) -> list[str]:
    return [f"Problem {i}: what is {i} + 1?" for i in range(count)]


def _run(url: str, prompts: list[str], n: int):
    params = SamplingParams(n=n, temperature=0.8, max_tokens=MAX_TOKENS, seed=0)
    with closing(load_llm("openai", base_url=url)) as llm:
        results = llm.generate(prompts, params)
        [stats] = llm.server_stats().values()
    return results, stats


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(CAPACITY))
def test_the_window_settles_near_each_engines_capacity(engine):
    """Within a factor of 2 of what the server decodes at once; then, with several samples a
    prompt, every sample asked for once: the server generated exactly n per prompt (none lost,
    duplicated or discarded)."""
    capacity = CAPACITY[engine]
    prompts = _prompts(round(12 * capacity / 0.34))  # about 12 longest sequences of work
    with fleet([(engine, capacity)], TICK_S) as [url]:
        results, stats = _run(url, prompts, n=1)
        assert [len(r) for r in results] == [1] * len(prompts)
        assert capacity / 2 <= stats["window"] <= 2 * capacity, stats
        assert stats["retries"] == 0 and stats["tokens_per_s"] > 0
        fleet_stats([url])
        n, few = 4, prompts[: 2 * capacity]
        results, stats = _run(url, few, n)
        [served] = fleet_stats([url])
    assert [len(r) for r in results] == [n] * len(few)
    assert len(served["spans"]) == n * len(few) == stats["sequences"]
    # llama.cpp: one more, the probe it refused
    requests = {"vllm": len(few), "ignores-n": n * len(few), "llama.cpp": n * len(few) + 1}
    assert served["requests"] == requests.get(engine, stats["requests"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "ignores-n"])
def test_the_window_follows_a_capacity_that_halves(engine):
    """A replica restarted with half the slots mid-run: the window comes down with it, and
    every sample still arrives, once."""
    capacity = 32
    prompts = _prompts(round(20 * capacity / 0.34))
    with fleet([(engine, capacity)], TICK_S) as [url]:
        params = SamplingParams(n=1, temperature=0.8, max_tokens=MAX_TOKENS, seed=0)
        with closing(load_llm("openai", base_url=url)) as llm:
            futures = llm.submit(prompts, params)
            while llm.server_stats()[url]["sequences"] < len(prompts) // 2:
                time.sleep(0.05)
            before = llm.server_stats()[url]["window"]
            httpx.post(f"{url}/resize", json={"batch": capacity // 2}, timeout=10)
            results = [f.result(timeout=300) for f in futures]
            stats = llm.server_stats()[url]
        [served] = fleet_stats([url])
    assert len(served["spans"]) == len(prompts) and all(len(r) == 1 for r in results)
    assert capacity // 2 <= before <= 2 * capacity
    # Read from the answers (no load report), the window swings about an eighth either way of
    # where it settles, and more on a busy machine: a margin over twice the capacity left.
    margin = 1.0 if engine == "vllm" else 1.25
    assert capacity // 4 <= stats["window"] <= capacity * margin, (before, stats)
    assert stats["window"] < before
    assert stats["retries"] == 0
