"""The openai backend against real `transformers serve` processes running the exported embedded
model (one shared, one started and killed here), and against canned servers on loopback for what
those cannot show (vLLM's `n`, Retry-After, malformed answers)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import closing

import pytest

from rstar_pipelines.llm import LLM, SamplingParams, load_llm
from rstar_pipelines.llm.openai_backend import LLMServerError, parse_base_urls, retry_after_s
from rstar_pipelines.llm.types import AsyncLLM, stream
from tests.fakes.openai_server import CannedServer, word_tokenizer
from tests.fakes.servers import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SAY_HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served_llm(transformers_server):
    with closing(load_llm("openai", base_url=transformers_server)) as llm:
        yield llm


@pytest.mark.slow
def test_names_the_served_model(served_llm, served_model_dir):
    assert isinstance(served_llm, LLM)
    # A pinned `transformers serve` only answers to the name it was started with.
    assert served_llm.model == str(served_model_dir)


@pytest.mark.slow
def test_greedy_text_and_counts_match_the_in_process_model(served_llm, embedded_fp32_llm):
    # The server serves the exported float32 weights: the in-process model with the same ones.
    prompts = ["The capital of France is", SAY_HI]
    params = GREEDY.model_copy(update={"max_tokens": 32})
    assert served_llm.generate(prompts, params) == embedded_fp32_llm.generate(prompts, params)


@pytest.mark.slow
def test_stop_string_is_cut_and_reported(served_llm):
    # transformers serve keeps the stop string in the text and reports only "stop".
    [[completion]] = served_llm.generate(
        ["The capital of France is"], GREEDY.model_copy(update={"stop": ["."]})
    )
    assert (completion.text, completion.finish_reason, completion.stop_string) == (
        " Paris",
        "stop",
        ".",
    )
    assert (completion.prompt_tokens, completion.completion_tokens) == (5, 2)


@pytest.mark.slow
def test_length_and_eos(served_llm):
    [[counted]] = served_llm.generate(["1, 2, 3, 4,"], GREEDY.model_copy(update={"max_tokens": 6}))
    assert (counted.finish_reason, counted.completion_tokens) == ("length", 6)
    [[hi]] = served_llm.generate([SAY_HI], GREEDY.model_copy(update={"max_tokens": 64}))
    assert hi.finish_reason == "eos" and hi.stop_string is None and 1 < hi.completion_tokens < 64


@pytest.mark.slow
def test_n_samples_one_request_each(served_llm):
    # transformers serve ignores n: the client sends one request per sample.
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)
    results = served_llm.generate(["The capital of France is", "Once upon a time"], params)
    assert [len(samples) for samples in results] == [3, 3]
    assert all(len({c.text for c in samples}) > 1 for samples in results)
    assert all(0 < c.completion_tokens <= 8 for samples in results for c in samples)


@pytest.mark.slow
def test_seed_reproduces_when_requests_are_sequential(transformers_server):
    # transformers serve seeds torch when a request arrives, not when it runs: only one request
    # at a time gives reproducible samples.
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    with closing(load_llm("openai", base_url=transformers_server, max_concurrency=1)) as llm:
        assert llm.generate(["Once upon a time"], params) == llm.generate(
            ["Once upon a time"], params
        )


@pytest.mark.slow
def test_continuing_an_assistant_message_is_refused_by_transformers_serve(served_llm):
    conversation = [*SAY_HI, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(LLMServerError, match="422.*continue_final_message"):
        served_llm.generate([conversation], GREEDY)


@pytest.mark.slow
def test_two_servers_share_a_batch_and_one_dies_mid_batch(
    transformers_server, start_server, embedded_fp32_llm
):
    """Samples spread across both servers; one is killed while it holds requests; every
    completion is still returned, once, and equals the model's own greedy answer."""
    server, other = start_server()
    prompts = [f"{i} + {i} =" for i in range(10)]
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    with closing(load_llm("openai", base_url=[transformers_server, other])) as llm:
        futures = llm.submit(prompts, params)
        deadline = time.monotonic() + 120
        while llm.server_stats()[other]["sequences"] < 2:  # it is serving: now kill it
            assert time.monotonic() < deadline, llm.server_stats()
            time.sleep(0.05)
        in_flight = llm.server_stats()[other]["in_flight"]
        os.killpg(server.pid, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
        stats = llm.server_stats()
    assert in_flight > 0  # it died holding requests, which went to the other server
    assert stats[transformers_server]["sequences"] >= 2 and stats[other]["sequences"] >= 2
    assert stats[transformers_server]["sequences"] + stats[other]["sequences"] == 20
    expected = embedded_fp32_llm.generate(prompts, params)
    assert results == expected


def test_submit_streams_each_prompt_as_it_finishes():
    release = threading.Event()

    def answer(method, path, body):
        if body and body["prompt"] == "slow":
            release.wait(10)
        return 200, _completion_json(body["prompt"].upper())

    with CannedServer(answer) as (url, _), served_by(url) as llm:
        assert isinstance(llm, AsyncLLM)
        order = []
        for index, [completion] in stream(llm, ["slow", "fast"], GREEDY):
            order.append((index, completion.text))
            release.set()
    assert order == [(1, "FAST"), (0, "SLOW")]


def test_what_waits_for_room_goes_lowest_priority_first():
    """Behind a window of one request, the prompts submitted while it is taken go out lowest
    priority first, in submission order within one priority."""
    release = threading.Event()

    def answer(method, path, body):
        if body and body["prompt"] == "first":
            release.wait(10)
        return 200, _completion_json(body["prompt"])

    with (
        CannedServer(answer) as (url, requests),
        closing(load_llm("openai", model="m", base_url=url, max_concurrency=1)) as llm,
    ):
        [first] = llm.submit(["first"], GREEDY, priority=9)
        wait_until(lambda: any(b and b["prompt"] == "first" for b in requests), "the first post")
        waiting = [(f"p{i}-{p}", p) for i, p in enumerate([2, 0, 1.5, 0, -1])]
        futures = [llm.submit([prompt], GREEDY, priority)[0] for prompt, priority in waiting]
        release.set()
        for future in [first, *futures]:
            future.result(timeout=30)
    sent = [body["prompt"] for body in requests if body is not None]
    assert sent == ["first", "p4--1", "p1-0", "p3-0", "p2-1.5", "p0-2"]


def test_all_samples_of_a_prompt_go_as_one_request_to_vllm():
    def answer(method, path, body):
        n = body.get("n", 1)
        choices = [
            {"index": i, "text": f"s{body['seed'] + i}", "finish_reason": "length",
             "token_ids": list(range(i + 1))}
            for i in range(n)
        ]  # fmt: skip
        return 200, {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 99}}

    params = SamplingParams(n=4, temperature=0.8, max_tokens=8, seed=10)
    with CannedServer(answer, owned_by="vllm") as (url, requests), served_by(url) as llm:
        [samples] = llm.generate(["p"], params)
        greedy = params.model_copy(update={"n": 2, "temperature": 0})
        [[greedy_a, greedy_b]] = llm.generate(["p"], greedy)
    posts = [body for body in requests if body is not None]
    assert [b.get("n") for b in posts] == [4, None, None]  # vLLM refuses n > 1 when greedy
    assert posts[0]["return_token_ids"] is True and posts[0]["seed"] == 10
    # vLLM seeds sample i with seed + i, as one request per sample would
    assert [c.text for c in samples] == ["s10", "s11", "s12", "s13"]
    assert [(c.completion_tokens, c.prompt_tokens) for c in samples] == [
        (1, 3),
        (2, 3),
        (3, 3),
        (4, 3),
    ]
    assert (greedy_a.text, greedy_b.text) == ("s10", "s11")


def test_a_server_that_ignores_n_gets_one_request_per_sample():
    def answer(method, path, body):
        return 200, _completion_json(f"s{body['seed']}")

    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, seed=0)
    with CannedServer(answer, owned_by="vllm") as (url, requests), served_by(url) as llm:
        [samples] = llm.generate(["p"], params)
        llm.generate(["q"], params)
    posts = [body for body in requests if body is not None]
    assert [c.text for c in samples] == ["s0", "s1", "s2"]
    assert [b.get("n") for b in posts] == [3, None, None, None, None, None]


def _seeded_choices(body: dict, n: int, token_ids: bool = False) -> dict:
    """`n` choices, choice i saying the seed it was drawn with (`seed + i`, as vLLM seeds)."""
    choices = [
        {"index": i, "text": f"s{body['seed'] + i}" * (i + 1), "finish_reason": "length"}
        | ({"token_ids": [0] * (i + 1)} if token_ids else {})
        for i in range(n)
    ]
    return {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 10 * n}}


@pytest.mark.parametrize("kind", ["honours n", "ignores n", "refuses n"])
def test_sample_i_gets_seed_plus_i_however_it_is_asked(kind):
    """Whether a server takes all samples in one request, answers one choice, or refuses n,
    sample i is drawn with seed + i, each sample is asked for once, and none is thrown away."""

    def answer(method, path, body):
        n = body.get("n", 1)
        if kind == "refuses n" and n > 1:
            return 500, {"error": {"message": "Only one completion choice is allowed"}}
        return 200, _seeded_choices(body, n if kind == "honours n" else 1)

    params = SamplingParams(n=5, temperature=0.8, max_tokens=8, seed=10)
    with CannedServer(answer) as (url, requests), served_by(url) as llm:
        results = llm.generate(["p", "q", "r"], params)
        results += llm.generate(["s"], params)  # after the probe's answer
    expected = [f"s{10 + i}" for i in range(5)]
    assert [[c.text[: len(e)] for c, e in zip(r, expected, strict=True)] for r in results] == [
        expected
    ] * 4
    asked = [(b["prompt"], b["seed"] + i) for b in requests for i in range(b.get("n", 1))]
    if kind == "refuses n":  # the probe it refused (llama.cpp) generated nothing
        asked = [(b["prompt"], b["seed"]) for b in requests if "n" not in b]
    if kind == "ignores n":  # what it was asked beyond its one choice, it never drew
        asked = [(b["prompt"], b["seed"]) for b in requests]
    assert sorted(asked) == sorted((p, 10 + i) for p in "pqrs" for i in range(5))
    assert max(b.get("n", 1) for b in requests) == {"honours n": 5, "ignores n": 2,
                                                    "refuses n": 2}[kind]  # fmt: skip


def test_usage_split_across_choices_is_flagged_as_an_estimate():
    def answer(method, path, body):
        return 200, _seeded_choices(body, body.get("n", 1))

    def ids(method, path, body):
        return 200, _seeded_choices(body, body.get("n", 1), token_ids=True)

    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=0)
    with CannedServer(answer) as (url, _), served_by(url) as llm:
        [[a, b]] = llm.generate(["p"], params)
    # 20 tokens in usage, split by text length ("s0" and "s1s1", each and EOS): 8 and 12
    assert (a.completion_tokens, b.completion_tokens) == (8, 12)
    assert a.tokens_estimated and b.tokens_estimated
    with CannedServer(ids) as (url, _), served_by(url) as llm:
        [[a, b]] = llm.generate(["p"], params)
    assert (a.completion_tokens, b.completion_tokens) == (1, 2)
    assert not a.tokens_estimated and not b.tokens_estimated


def test_choices_without_token_ids_are_counted_by_the_served_models_tokenizer(tmp_path):
    """The served model is a directory on this machine: its tokenizer counts each choice (text,
    stop string and end of sequence), no estimate; a model it cannot find is split from usage."""
    model = str(word_tokenizer(tmp_path / "served"))
    texts = ["one two, three", "four five END"]

    def answer(method, path, body):  # sample i (seeded seed + i) says texts[i]
        asked = texts[body["seed"] : body["seed"] + body.get("n", 1)]
        choices = [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(asked)]
        return 200, {"choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": 99}}

    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=0, stop=["END"])
    with CannedServer(answer, models=(model,)) as (url, _):
        with closing(load_llm("openai", base_url=url)) as llm:
            [completions] = llm.generate(["p"], params)
        with closing(load_llm("openai", model="not/on-this-machine", base_url=url)) as llm:
            [estimated] = llm.generate(["p"], params)
    # words, the comma and the end of sequence; words and the stop string the second ended on
    assert [c.completion_tokens for c in completions] == [5, 3]
    assert [c.finish_reason for c in completions] == ["eos", "stop"]
    assert not any(c.tokens_estimated for c in completions)
    assert sum(c.completion_tokens for c in estimated) == 99
    assert all(c.tokens_estimated for c in estimated)


def test_retry_after_is_honoured():
    times = []

    def answer(method, path, body):
        times.append(time.monotonic())
        if len(times) == 1:
            return 429, {"error": "queue full"}, {"Retry-After": "1"}
        return 200, _completion_json("ok")

    with CannedServer(answer) as (url, _), served_by(url) as llm:
        [[completion]] = llm.generate(["hi"], GREEDY)
    assert completion.text == "ok" and len(times) == 2
    assert times[1] - times[0] >= 0.95
    assert retry_after_s("2.5") == 2.5 and retry_after_s(None) is None
    in_a_minute = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 60))
    assert 0 < retry_after_s(in_a_minute) <= 60


def test_a_dead_server_in_the_list_is_left_out():
    def answer(method, path, body):
        return 200, _completion_json(body["prompt"])

    dead = closed_port_url()
    with CannedServer(answer) as (url, _):
        llm = load_llm("openai", model="m", base_url=f"{dead},{url}", retry_backoff=0.05)
        with closing(llm):
            results = llm.generate([f"p{i}" for i in range(20)], GREEDY)
            stats = llm.server_stats()
    assert [r[0].text for r in results] == [f"p{i}" for i in range(20)]
    assert stats[url]["sequences"] == 20 and stats[dead]["sequences"] == 0


def test_refused_connection_is_retried_then_reported():
    url = closed_port_url()
    llm = load_llm("openai", model="m", base_url=url, max_retries=2, retry_backoff=0.1)
    started = time.monotonic()
    failure = f"no server answers.*failed 3 times in a row.*{url}: ClientConnectorError"
    with closing(llm), pytest.raises(LLMServerError, match=failure):
        llm.generate(["hi"], GREEDY)
    assert time.monotonic() - started >= 0.3  # backoffs 0.1 + 0.2


def test_server_errors_are_retried():
    answers = [(503, {"error": "busy"}), (503, {"error": "busy"}), (200, _completion_json("ok"))]
    with CannedServer(lambda *_: answers.pop(0)) as (url, requests), served_by(url) as llm:
        [[completion]] = llm.generate(["hi"], GREEDY)
    assert completion.text == "ok" and completion.finish_reason == "eos"
    assert len([r for r in requests if r is not None]) == 3


def test_client_errors_are_not_retried():
    with (
        CannedServer(lambda *_: (400, {"error": "bad request"})) as (url, requests),
        served_by(url) as llm,
        pytest.raises(LLMServerError, match="HTTP 400.*bad request"),
    ):
        llm.generate(["hi"], GREEDY)
    assert len([r for r in requests if r is not None]) == 1


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("http://127.0.0.1:8000/v1,http//127.0.0.1:8001/v1", "server 2 of 2.*http:// or https://"),
        ("http://127.0.0.1:8000/v1,", "server 2 of 2, ''.*is empty"),
        ("http://127.0.0.1:8000/v1 http://127.0.0.1:8001/v1", "server 1 of 1.*spaces"),
        ("http://:8000/v1", "names no host"),
        ("http://127.0.0.1:80000/v1", "bad port"),
        ("http://a:1/v1,http://a:1/v1/", "server 2 of 2.*listed twice"),
    ],
)
def test_malformed_server_lists_are_refused(value, problem):
    with pytest.raises(ValueError, match=f"RSTAR_LLM_BASE_URL: .*{problem}"):
        parse_base_urls(value, "RSTAR_LLM_BASE_URL")


def test_server_lists_parse():
    assert parse_base_urls(" http://a:1/v1/ , https://b/v1") == ["http://a:1/v1", "https://b/v1"]
    assert parse_base_urls(["http://a:1/v1", "http://b:2/v1,http://c:3/v1"]) == [
        "http://a:1/v1",
        "http://b:2/v1",
        "http://c:3/v1",
    ]


def served_by(url: str):
    return closing(load_llm("openai", model="m", base_url=url, retry_backoff=0.01))


def _completion_json(text: str) -> dict:
    return {
        "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def closed_port_url() -> str:
    """A loopback URL on which nothing listens (a port the OS just handed out and took back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
