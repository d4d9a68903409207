"""The openai backend against a real `transformers serve` running the exported embedded model."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rstar_pipelines.llm import LLM, SamplingParams, load_llm
from rstar_pipelines.llm.openai_backend import LLMServerError

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SAY_HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served_llm(transformers_server):
    with closing(load_llm("openai", base_url=transformers_server)) as llm:
        yield llm


def test_names_the_served_model(served_llm, served_model_dir):
    assert isinstance(served_llm, LLM)
    # A pinned `transformers serve` only answers to the name it was started with.
    assert served_llm.model == str(served_model_dir)


def test_greedy_text_and_counts_match_the_in_process_model(served_llm, embedded_llm):
    prompts = ["The capital of France is", SAY_HI]
    params = GREEDY.model_copy(update={"max_tokens": 32})
    assert served_llm.generate(prompts, params) == embedded_llm.generate(prompts, params)


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


def test_length_and_eos(served_llm):
    [[counted]] = served_llm.generate(["1, 2, 3, 4,"], GREEDY.model_copy(update={"max_tokens": 6}))
    assert (counted.finish_reason, counted.completion_tokens) == ("length", 6)
    [[hi]] = served_llm.generate([SAY_HI], GREEDY.model_copy(update={"max_tokens": 64}))
    assert hi.finish_reason == "eos" and hi.stop_string is None and 1 < hi.completion_tokens < 64


def test_n_samples_one_request_each(served_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)
    results = served_llm.generate(["The capital of France is", "Once upon a time"], params)
    assert [len(samples) for samples in results] == [3, 3]
    assert all(len({c.text for c in samples}) > 1 for samples in results)
    assert all(0 < c.completion_tokens <= 8 for samples in results for c in samples)


def test_seed_reproduces_when_requests_are_sequential(transformers_server):
    # transformers serve seeds torch when a request arrives, not when it runs: only one request
    # at a time gives reproducible samples.
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    with closing(load_llm("openai", base_url=transformers_server, max_concurrency=1)) as llm:
        assert llm.generate(["Once upon a time"], params) == llm.generate(
            ["Once upon a time"], params
        )


def test_continuing_an_assistant_message_is_refused_by_transformers_serve(served_llm):
    conversation = [*SAY_HI, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(LLMServerError, match="422.*continue_final_message"):
        served_llm.generate([conversation], GREEDY)


def test_refused_connection_is_retried_then_reported():
    url = closed_port_url()
    llm = load_llm("openai", model="m", base_url=url, max_retries=2, retry_backoff=0.1)
    started = time.monotonic()
    failure = f"POST {url}/completions failed after 3 attempts.*ConnectError"
    with closing(llm), pytest.raises(LLMServerError, match=failure):
        llm.generate(["hi"], GREEDY)
    assert time.monotonic() - started >= 0.3  # backoffs 0.1 + 0.2


def test_server_errors_are_retried():
    answers = [(503, {"error": "busy"}), (503, {"error": "busy"}), (200, _completion_json("ok"))]
    with canned_server(answers) as (url, requests), served_by(url) as llm:
        [[completion]] = llm.generate(["hi"], GREEDY)
    assert completion.text == "ok" and completion.finish_reason == "eos"
    assert len(requests) == 3


def test_client_errors_are_not_retried():
    answers = [(400, {"error": "bad request"})] * 3
    with (
        canned_server(answers) as (url, requests),
        served_by(url) as llm,
        pytest.raises(LLMServerError, match="HTTP 400.*bad request"),
    ):
        llm.generate(["hi"], GREEDY)
    assert len(requests) == 1


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


class canned_server:
    """A loopback HTTP server that answers POSTs with the given (status, JSON) answers in turn."""

    def __init__(self, answers: list[tuple[int, dict]]):
        self.answers = list(answers)
        self.requests: list[dict] = []

    def __enter__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.requests.append(
                    json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                )
                status, body = outer.answers.pop(0)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1", self.requests

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
