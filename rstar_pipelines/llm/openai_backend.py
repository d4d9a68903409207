"""Generation through any OpenAI-compatible server: vLLM, SGLang, `transformers serve`, llama.cpp.

Raw string prompts go to `POST {base_url}/completions`, chat prompts to
`POST {base_url}/chat/completions`.
Each (prompt, sample) is its own request with n=1 (and seed + sample index when a seed is given),
so the usage counts are exact per completion and servers that ignore `n` still give n samples.
Requests run concurrently (`max_concurrency`); connection errors, 5xx and 429 are retried with
exponential backoff (`max_retries`). `model` defaults to the first model the server lists.

How finish reasons are mapped: "length" stays "length"; a completion whose text contains a stop
string (some servers do not strip it) is cut there and is "stop"; a "stop" with vLLM's `stop_reason`
set to a string is "stop" with that string; any other "stop" is "eos".

A chat prompt that ends with an assistant message asks the server to continue that message with
vLLM's (and SGLang's) extension fields `continue_final_message` and `add_generation_prompt`.

What `transformers serve` (transformers 5.24) does, read from its source and checked against it:
- It serves both /v1/completions and /v1/chat/completions, non-streaming and streaming.
- `model` must be the name the server was started with (or left out); /v1/models lists it.
- It ignores `n` (logs a warning) and answers one choice: hence one request per sample here.
- It sets the request's temperature and top_p but never turns sampling on: a model whose
  generation_config.json lacks `do_sample: true` decodes greedily whatever the temperature
  (`export_embedded_model` writes do_sample=true; temperature 0 still means greedy).
- `stop` works, but the text keeps the stop string and there is no `stop_reason`; we cut the text.
- `finish_reason` is only "length" (when completion_tokens reached max_tokens, even if the last
  token was EOS or ended a stop string) or "stop"; EOS and stop strings are told apart by the
  text.
- `seed` calls torch.manual_seed when the request arrives, while generation runs later on one
  inference thread: concurrent requests interleave seeds, so seeded runs reproduce only with
  max_concurrency=1.
- Text is decoded with skip_special_tokens=True, so special tokens the model writes are dropped.
- It rejects unknown request fields (HTTP 422), so continuing a final assistant message fails there.
- `usage` holds exact prompt and completion token counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .types import Completion, Prompt, SamplingParams, is_chat, truncate_at_stop

_RETRIED_STATUS = {429, 500, 502, 503, 504}


class LLMServerError(RuntimeError):
    """The server could not be reached or refused a request."""


class OpenAILLM:
    """An LLM behind an OpenAI-compatible HTTP API."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_concurrency: int = 16,
        max_retries: int = 4,
        retry_backoff: float = 0.5,
        timeout: float = 600.0,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be at least 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency
            ),
        )
        self._model = model
        self.name = f"openai:{self.base_url}" + (f":{model}" if model else "")

    @property
    def model(self) -> str:
        """The model named in requests: the one given, else the first the server lists."""
        if self._model is None:
            listed = self._request("GET", "/models").get("data") or []
            if not listed:
                raise LLMServerError(
                    f"{self.base_url}/models lists no model; pass model= explicitly"
                )
            self._model = listed[0]["id"]
        return self._model

    def close(self) -> None:
        self._client.close()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        bodies = [
            (prompt, self._body(prompt, params, sample))
            for prompt in prompts
            for sample in range(params.n)
        ]
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            flat = list(pool.map(lambda job: self._complete(*job, params.stop), bodies))
        return [flat[i : i + params.n] for i in range(0, len(flat), params.n)]

    def _body(self, prompt: Prompt, params: SamplingParams, sample: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed + sample
        if not is_chat(prompt):
            body["prompt"] = prompt
            return body
        body["messages"] = [dict(m) for m in prompt]
        if body["messages"] and body["messages"][-1].get("role") == "assistant":
            body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    def _complete(self, prompt: Prompt, body: dict[str, Any], stop: Sequence[str]) -> Completion:
        path = "/chat/completions" if is_chat(prompt) else "/completions"
        answer = self._request("POST", path, body)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] if is_chat(prompt) else choice["text"]
            usage = answer["usage"]
            prompt_tokens, completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        except (KeyError, IndexError, TypeError) as exc:
            raise LLMServerError(
                f"{self.base_url}{path} answered without {exc}: {answer!r:.500}"
            ) from exc
        text, stop_string = truncate_at_stop(text or "", stop)
        reason = choice.get("finish_reason")
        if stop_string is None and reason == "stop" and isinstance(choice.get("stop_reason"), str):
            # vLLM strips the stop string from the text and names it here.
            stop_string = choice["stop_reason"]
        if stop_string is not None:
            finish = "stop"
        else:
            finish = "length" if reason == "length" else "eos"
        return Completion(text, finish, stop_string, prompt_tokens, completion_tokens)

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        url = self.base_url + path
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._client.request(method, url, json=body)
            except httpx.TransportError as exc:
                failure = repr(exc)
            else:
                if response.status_code < 400:
                    return response.json()
                failure = f"HTTP {response.status_code}: {response.text[:1000]}"
                if response.status_code not in _RETRIED_STATUS:
                    raise LLMServerError(f"{method} {url} answered {failure}")
            if attempt > self.max_retries:
                raise LLMServerError(f"{method} {url} failed after {attempt} attempts: {failure}")
            time.sleep(self.retry_backoff * 2 ** (attempt - 1))
