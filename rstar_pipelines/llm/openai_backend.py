"""Generation through OpenAI-compatible servers (vLLM, SGLang, `transformers serve`, llama.cpp):
one server or a fleet of them, kept busy.

Raw string prompts go to `POST {base_url}/completions`, chat prompts to
`POST {base_url}/chat/completions`. `base_url` is one URL, several separated by commas, or a
list; a malformed one is refused when the client is built (`parse_base_urls`).

How the fleet is used (docs/llm-serving.md):
- Each server is asked `GET /models` first: a vLLM server says `owned_by: "vllm"`
  (vllm/entrypoints/serve/engine/protocol.py, line 109, in vLLM 0.32.0). `model` defaults to
  the first model the first answering server lists.
- All samples of a prompt go as ONE request with `n` to a server that honours it, and every
  choice of an answer is kept. vLLM honours `n`, and gives each sample the seed `seed + index`
  (vllm/v1/engine/parallel_sampling.py, line 81), as our one-request-per-sample fallback does;
  its `return_token_ids` gives each sample's token count. Any other server is probed once: the
  first prompt with several samples asks it for two; a server that answers fewer choices than
  asked (`transformers serve` answers one) or refuses `n` (llama.cpp answers HTTP 500 "Only one
  completion choice is allowed") gets one request per sample from then on, and what it did
  answer is kept. One request per sample at temperature 0 too (vLLM refuses n > 1 for greedy
  sampling). `n_per_request` declares it instead. A request for samples i.. carries the seed
  `seed + i`, so sample i gets `seed + i` whichever way it is asked for.
- Each sample's token count: from `token_ids` where given, else from the served model's
  tokenizer where it is on this machine (a local directory or the Hugging Face cache), else
  the answer's `usage` split across its choices by text length and flagged
  (`Completion.tokens_estimated`).
- Each server has a window (sequences in flight, a request with n samples counting n) that
  finds its capacity (`fleet_window.AdaptiveWindow`): it starts at 16 and grows while the server
  decodes all it gets, read from the engine's `/metrics` (vLLM, SGLang, TGI, llama.cpp) or
  llama.cpp's `/slots` where it answers them, else from the answers' decode speed; it settles
  with a small queue at the server. `max_concurrency` caps it. New work goes to the least
  loaded server.
- 429 and 503 with `Retry-After`: nothing more goes to that server until then, and its window
  halves. Connection errors, 5xx and 429 without it: the server backs off exponentially, its
  window drops to one request until it answers, and the request moves to another server (or
  waits for one). A request that died with its server is sent again elsewhere; its completions
  are recorded once, when an answer arrives, so none is lost or duplicated. The error comes
  when a request has failed `max_retries + 1` times, or every server has failed that many times
  in a row.
- `server_stats()` reports, per server: the window, requests, sequences, tokens, tokens/s,
  retries (the stage metadata's `llm_servers` table). `spare_capacity()` is the room left in
  the windows less what waits to be sent: a caller that opens work while it is above 0 (the
  search opening trees) keeps the fleet full without knowing its size; `on_room(callback)` wakes
  such a caller when room appears with no answer of its own to wake it (a window grew).
- `submit` returns one future per prompt, resolved as soon as that prompt's samples are in;
  `generate` waits for all of them. Requests run on an asyncio loop (aiohttp) in a thread of
  the client.

How finish reasons are mapped: "length" stays "length"; a completion whose text contains a stop
string (some servers do not strip it) is cut there and is "stop"; a "stop" with vLLM's `stop_reason`
set to a string is "stop" with that string; any other "stop" is "eos".

A chat prompt that ends with an assistant message asks the server to continue that message with
vLLM's (and SGLang's) extension fields `continue_final_message` and `add_generation_prompt`.

What `transformers serve` (transformers 5.24) does, read from its source and checked against it:
- It serves both /v1/completions and /v1/chat/completions, non-streaming and streaming.
- `model` must be the name the server was started with (or left out); /v1/models lists it.
- It ignores `n` (logs a warning) and answers one choice: hence one request per sample there.
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

import asyncio
import email.utils
import heapq
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from .fleet_window import (
    START,
    AdaptiveWindow,
    Load,
    load_from_metrics,
    load_from_slots,
)
from .types import Completion, Prompt, SamplingParams, is_chat, truncate_at_stop

_RETRIED_STATUS = {429, 500, 502, 503, 504}
# What a server that does not take `n` answers a request with n > 1: llama.cpp says HTTP 500
# "Only one completion choice is allowed" (400 in some versions), others 400 or 422.
_REFUSED_N_STATUS = {400, 422, 500}
# vLLM's greedy threshold (vllm/sampling_params.py, _SAMPLING_EPS): n > 1 is refused below it.
GREEDY_BELOW = 1e-5
MAX_BACKOFF_S = 30.0


class LLMServerError(RuntimeError):
    """The servers could not be reached or refused a request."""


def parse_base_urls(value: str | Sequence[str], source: str = "base_url") -> list[str]:
    """The server URLs in `value` (a URL, URLs separated by commas, or a list of them); a clear
    error naming `source` and the position of a malformed or repeated one."""
    items = value.split(",") if isinstance(value, str) else [u for v in value for u in v.split(",")]
    urls: list[str] = []
    for position, raw in enumerate(items, 1):
        url = raw.strip()
        parsed = urlsplit(url)
        if not url:
            problem = "is empty"
        elif parsed.scheme not in ("http", "https") or not url.startswith(f"{parsed.scheme}://"):
            problem = "does not start with http:// or https://"
        elif not parsed.hostname:
            problem = "names no host"
        elif any(c.isspace() for c in url) or parsed.query or parsed.fragment:
            problem = "holds spaces, a query or a fragment"
        else:
            try:
                parsed.port  # noqa: B018 - raises ValueError on a bad port
                problem = None
            except ValueError as err:
                problem = f"has a bad port ({err})"
        if problem is None and url.rstrip("/") in urls:
            problem = "is listed twice"
        if problem:
            raise ValueError(
                f"{source}: server {position} of {len(items)}, {raw!r}, {problem} (expected "
                "http://HOST:PORT/v1, several separated by commas)"
            )
        urls.append(url.rstrip("/"))
    return urls


def retry_after_s(header: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date), None if absent."""
    if not header:
        return None
    try:
        return max(0.0, float(header))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(header).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


@dataclass(eq=False)
class _Server:
    url: str
    window: AdaptiveWindow | None = None  # None until GET /models answered
    honours_n: bool | None = None  # None: not yet probed
    probing_n: bool = False  # a request with n=2 is out to find out
    vllm: bool = False
    load_path: str | None = None  # "/metrics" or "/slots" where the engine reports its load
    in_flight: int = 0
    failures: int = 0  # in a row
    last_failure: str = ""
    ready_at: float = 0.0  # loop time before which nothing is sent
    probing: bool = False
    requests: int = 0  # answered
    sequences: int = 0
    tokens: int = 0
    retries: int = 0
    first_sent: float | None = None
    last_answer: float = 0.0

    @property
    def root(self) -> str:
        """The server's address without the API path (/metrics and /slots live there)."""
        return self.url.removesuffix("/v1")


@dataclass(eq=False)
class _Prompt:
    prompt: Prompt
    params: SamplingParams
    future: Future
    completions: list[Completion | None]
    priority: float = 0.0
    started: bool = False


@dataclass(eq=False)
class _Job:
    """Some samples of one prompt, sent as one request."""

    owner: _Prompt
    samples: list[int]
    failures: list[str] = field(default_factory=list)
    failed_on: set[str] = field(default_factory=set)


class _Queue:
    """The jobs waiting for a server, lowest priority first and in the order they came within
    one priority; a job put back (`appendleft`: a retry, the rest of a split request) goes
    first within its priority. `sequences` (the samples the jobs hold) is kept as jobs come
    and go, so that `spare_capacity` reads it without walking the queue."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Job]] = []
        self._order = itertools.count()
        self.sequences = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[_Job]:
        return (job for _, _, job in self._heap)

    def __getitem__(self, index: Literal[0]) -> _Job:
        return self._heap[index][2]

    def append(self, job: _Job) -> None:
        self._push(job, next(self._order))

    def appendleft(self, job: _Job) -> None:
        self._push(job, -next(self._order))

    def extend(self, jobs: Sequence[_Job]) -> None:
        for job in jobs:
            self.append(job)

    def popleft(self) -> _Job:
        job = heapq.heappop(self._heap)[2]
        self.sequences -= len(job.samples)
        return job

    def clear(self) -> None:
        self._heap.clear()
        self.sequences = 0

    def _push(self, job: _Job, order: int) -> None:
        heapq.heappush(self._heap, (job.owner.priority, order, job))
        self.sequences += len(job.samples)


@dataclass(frozen=True)
class _Sent:
    """A request on its way: its samples, the window's round and when it went."""

    job: _Job
    size: int
    round: int
    at: float


class OpenAILLM:
    """An LLM behind one or more OpenAI-compatible HTTP servers."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_concurrency: int | None = None,
        n_per_request: bool | None = None,
        max_retries: int = 4,
        retry_backoff: float = 0.5,
        timeout: float = 3600.0,
    ):
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be at least 0, got {max_retries}")
        self.base_urls = parse_base_urls(base_url)
        self.max_concurrency = max_concurrency
        self.n_per_request = n_per_request
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self._timeout = aiohttp.ClientTimeout(sock_connect=min(30.0, timeout), sock_read=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._servers = [_Server(url) for url in self.base_urls]
        self._model = model
        self._tokenizer: Any = None
        self._tokenizer_lookup: asyncio.Task | None = None
        self.name = f"openai:{','.join(self.base_urls)}" + (f":{model}" if model else "")
        self._queue = _Queue()
        self._incoming = 0  # samples submitted and not yet in the queue
        self._incoming_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._room_callbacks: tuple[Callable[[], None], ...] = ()  # replaced whole: read lock-free
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the caller's side (any thread) --------------------------------------------------------

    @property
    def model(self) -> str:
        """The model named in requests: the one given, else the first the servers list."""
        if self._model is None:
            asyncio.run_coroutine_threadsafe(self._find_model(), self._running_loop()).result()
        return self._model

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, priority: float = 0.0
    ) -> list[Future[list[Completion]]]:
        """One future per prompt. What waits for room in the windows goes out lowest
        `priority` first (vLLM's sense), in submission order within one priority."""
        owners = [_Prompt(p, params, Future(), [None] * params.n, priority) for p in prompts]
        jobs = [_Job(owner, list(range(params.n))) for owner in owners]
        with self._incoming_lock:
            self._incoming += len(prompts) * params.n
        self._running_loop().call_soon_threadsafe(self._enqueue, jobs)
        return [owner.future for owner in owners]

    def spare_capacity(self) -> int:
        """How many more sequences the fleet would start now: the room left in the windows
        of the servers that answer (a server not yet asked counts its first window), less the
        samples submitted and not yet sent. At most 0 when the windows are full; a caller that
        opens work while it is above 0 keeps each server's window full, so the windows go on
        growing to what the servers run (fleet_window)."""
        room = 0
        for server in self._servers:
            window = server.window
            if server.failures:
                continue  # backing off: its window is one request until it answers
            limit = START if window is None else window.limit
            room += max(0, limit - server.in_flight)
        return room - self._queue.sequences - self._incoming

    def on_room(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback` (from the client's thread) each time the client has sent what it
        can and the windows still have room (`spare_capacity` above 0): after a window grows,
        a server comes up, answers free room. Returns what stops the calls."""
        with self._start_lock:
            self._room_callbacks = (*self._room_callbacks, callback)

        def stop() -> None:
            with self._start_lock:
                self._room_callbacks = tuple(c for c in self._room_callbacks if c is not callback)

        return stop

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        futures = self.submit(prompts, params)
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        with self._start_lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                ready = threading.Event()
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._run_loop, args=(self._loop, ready), name="openai-llm", daemon=True
                )
                self._thread.start()
                ready.wait()
            return self._loop

    # -- the loop's side ------------------------------------------------------------------------

    def _run_loop(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        loop.call_soon(self._start, self._dispatch_forever())
        loop.call_soon(ready.set)
        loop.run_forever()

    async def _shutdown(self) -> None:
        for job in self._queue:
            job.owner.future.cancel()
        self._queue.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()

    def _enqueue(self, jobs: list[_Job]) -> None:
        self._queue.extend(jobs)
        with self._incoming_lock:
            self._incoming -= sum(len(job.samples) for job in jobs)
        self._wake.set()

    async def _dispatch_forever(self) -> None:
        # aiohttp, not httpx: httpx's connection pool scans every connection per request, which
        # costs more than the requests themselves with a thousand in flight.
        self._session = aiohttp.ClientSession(
            headers=self._headers,
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(limit=0),  # the windows bound what is in flight
        )
        while True:
            self._wake.clear()
            delay = self._dispatch()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass

    def _dispatch(self) -> float | None:
        """Send what the servers have room for; the seconds until a paused server may take
        more (None: wait to be woken)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for server in self._servers:
            if server.window is None and not server.probing and server.ready_at <= now:
                server.probing = True
                self._start(self._probe(server))
        if self._queue and all(s.failures > self.max_retries for s in self._servers):
            self._fail_everything()
            return None
        while self._queue:
            job = self._queue[0]
            if job.owner.future.cancelled():
                self._queue.popleft()
                continue
            server = self._pick(job, now)
            if server is None:
                break
            self._queue.popleft()
            size = self._size(server, job)
            if size < len(job.samples):  # the rest goes as another request, to whichever server
                rest = _Job(job.owner, job.samples[size:], list(job.failures), set(job.failed_on))
                self._queue.appendleft(rest)
                job.samples = job.samples[:size]
            if not job.owner.started:
                job.owner.started = True
                if not job.owner.future.set_running_or_notify_cancel():
                    continue
            if server.honours_n is None and size > 1:
                server.probing_n = True
            server.in_flight += size
            server.first_sent = now if server.first_sent is None else server.first_sent
            self._start(
                self._send(
                    server, _Sent(job, size, server.window.sent(server.in_flight, size), now)
                )
            )
        if not self._queue and self._room_callbacks and self.spare_capacity() > 0:
            for callback in self._room_callbacks:
                callback()
        waits = [s.ready_at - now for s in self._servers if s.ready_at > now]
        return min(waits) if waits and self._queue else None

    def _start(self, coroutine: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # the loop keeps only weak references to its tasks
        task.add_done_callback(self._tasks.discard)
        return task

    def _size(self, server: _Server, job: _Job) -> int:
        """How many of the job's samples go in one request to `server`: all where it honours
        `n`; two to find out whether it does (one such request at a time); else one."""
        samples = len(job.samples)
        if samples == 1 or job.owner.params.temperature < GREEDY_BELOW:
            return 1
        if server.honours_n is None:
            return 1 if server.probing_n else 2
        return samples if server.honours_n else 1

    def _pick(self, job: _Job, now: float) -> _Server | None:
        """The least loaded server with room for the job; not one it failed on while a healthy
        server is left (the job then waits for room there)."""
        usable = [s for s in self._servers if s.window is not None]
        if any(s.failures == 0 and s.url not in job.failed_on for s in usable):
            usable = [s for s in usable if s.url not in job.failed_on]
        ready = [
            s
            for s in usable
            if s.ready_at <= now
            and (s.in_flight == 0 or s.in_flight + self._size(s, job) <= s.window.limit)
        ]
        return min(ready, key=lambda s: s.in_flight / s.window.limit, default=None)

    def server_stats(self) -> dict[str, dict[str, float]]:
        """Per server: its window (sequences in flight at most), requests and sequences
        answered, completion tokens and tokens/s (from its first request to its last answer),
        retries, failures in a row and sequences in flight."""
        loop_time = self._loop.time() if self._loop is not None else 0.0
        return {s.url: _report(s, loop_time) for s in self._servers}

    def _fail_everything(self) -> None:
        report = "; ".join(f"{s.url}: {s.last_failure}" for s in self._servers)
        error = LLMServerError(
            f"no server answers ({len(self._servers)} tried, each failed "
            f"{self.max_retries + 1} times in a row): {report}"
        )
        while self._queue:
            self._settle_error(self._queue.popleft().owner, error)

    async def _probe(self, server: _Server) -> None:
        try:
            listed = (await self._get(server.url + "/models")).get("data") or []
            if not listed and self._model is None:
                raise LLMServerError(f"{server.url}/models lists no model; pass model=")
        except (aiohttp.ClientError, TimeoutError, LLMServerError, ValueError) as exc:
            self._server_failed(server, _describe(exc))
            server.probing = False
            self._wake.set()
            return
        if self._model is None:
            self._model = listed[0]["id"]
        fallback = listed[0] if listed else {}
        entry = next((m for m in listed if m.get("id") == self._model), fallback)
        server.vllm = entry.get("owned_by") == "vllm"
        server.honours_n = True if server.vllm else self.n_per_request
        if not server.vllm:  # before it answers: its choices may come without token ids
            await self._look_up_tokenizer()
        server.load_path = await self._load_path(server)
        reports_load = server.load_path is not None
        server.window = AdaptiveWindow(cap=self.max_concurrency, reports_load=reports_load)
        if reports_load:
            self._start(self._watch_load(server))
        server.failures = 0
        server.probing = False
        self._wake.set()

    async def _look_up_tokenizer(self) -> None:
        """The served model's tokenizer where it is on this machine, looked up once per client
        (the servers probed meanwhile wait for the same lookup)."""
        if self._tokenizer_lookup is None:
            self._tokenizer_lookup = self._start(asyncio.to_thread(_local_tokenizer, self._model))
        self._tokenizer = await asyncio.shield(self._tokenizer_lookup)

    async def _load_path(self, server: _Server) -> str | None:
        """Where the server reports its load: `/metrics` with gauges this client reads, else
        llama.cpp's `/slots`, else nowhere."""
        for path in ("/metrics", "/slots"):
            try:
                await self._load(server, path)
                return path
            except (aiohttp.ClientError, TimeoutError, LLMServerError, ValueError):
                continue
        return None

    async def _load(self, server: _Server, path: str) -> Load:
        url = server.root + path
        async with self._session.get(url) as response:
            if response.status >= 400:
                raise LLMServerError(f"GET {url} answered HTTP {response.status}")
            if path == "/slots":
                return load_from_slots(await response.json(content_type=None), server.in_flight)
            load = load_from_metrics(await response.text())
        if load is None:
            raise LLMServerError(f"GET {url} reports no running and waiting gauges")
        return load

    async def _watch_load(self, server: _Server) -> None:
        """Size the window from the server's load while it has work."""
        while True:
            await asyncio.sleep(server.window.poll_s)
            if server.in_flight == 0 or server.failures:
                continue
            try:
                load = await self._load(server, server.load_path)
            except (aiohttp.ClientError, TimeoutError, LLMServerError, ValueError):
                continue  # a failed report is no sign of load: requests say more
            server.window.observe(load, server.in_flight)
            self._wake.set()

    async def _find_model(self) -> None:
        while self._model is None:
            if all(s.failures > self.max_retries for s in self._servers):
                report = "; ".join(f"{s.url}: {s.last_failure}" for s in self._servers)
                raise LLMServerError(f"no server lists a model: {report}")
            self._wake.set()
            await asyncio.sleep(0.05)

    async def _get(self, url: str) -> dict[str, Any]:
        async with self._session.get(url) as response:
            if response.status >= 400:
                raise LLMServerError(f"GET {url} answered HTTP {response.status}")
            return await response.json(content_type=None)

    async def _send(self, server: _Server, sent: _Sent) -> None:
        job, size = sent.job, sent.size
        path = "/chat/completions" if is_chat(job.owner.prompt) else "/completions"
        url = server.url + path
        body = self._body(job.owner.prompt, job.owner.params, job.samples[0], size, server.vllm)
        try:
            async with self._session.post(url, json=body) as response:
                status, text = response.status, await response.text()
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._retry(server, job, _describe(exc))
            return
        finally:
            server.in_flight -= size
            if size > 1 and server.honours_n is None:
                server.probing_n = False
            self._wake.set()
        if status < 400:
            self._answered(server, sent, path, text)
        elif size > 1 and server.honours_n is None and status in _REFUSED_N_STATUS:
            server.honours_n = False  # it refuses n: one request per sample there
            self._queue.appendleft(job)
        elif status not in _RETRIED_STATUS:
            failure = f"HTTP {status}: {text[:1000]}"
            self._settle_error(job.owner, LLMServerError(f"POST {url} answered {failure}"))
        else:
            self._refused(server, job, status, text, retry_after)

    def _refused(
        self, server: _Server, job: _Job, status: int, text: str, retry_after: str | None
    ) -> None:
        server.retries += 1
        pause = retry_after_s(retry_after)
        if pause is not None and status in (429, 503):
            # The server asks for time: give it that, and fewer requests from now on.
            server.ready_at = max(server.ready_at, asyncio.get_running_loop().time() + pause)
            server.window.overloaded()
            self._queue.appendleft(job)
            return
        self._retry(server, job, f"HTTP {status}: {text[:1000]}")

    def _answered(self, server: _Server, sent: _Sent, path: str, text: str) -> None:
        job = sent.job
        owner = job.owner
        try:
            completions = self._completions(json.loads(text), owner, len(job.samples))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            error = f"{server.url}{path} answered without {exc}: {text[:500]}"
            self._settle_error(owner, LLMServerError(error))
            return
        now = asyncio.get_running_loop().time()
        tokens = sum(c.completion_tokens for c in completions)
        server.failures = 0
        server.requests += 1
        server.sequences += len(completions)
        server.tokens += tokens
        server.last_answer = now
        if server.window.answered(sent.round, len(completions), tokens, now - sent.at):
            server.window.decide()
        if len(job.samples) > 1 and server.honours_n is None:
            server.honours_n = len(completions) == len(job.samples)
        for sample, completion in zip(job.samples, completions, strict=False):
            owner.completions[sample] = completion
        if len(completions) < len(job.samples):  # it ignored n: one request per sample there
            server.honours_n = False
            self._queue.appendleft(_Job(owner, job.samples[len(completions) :]))
        elif all(c is not None for c in owner.completions) and not owner.future.done():
            owner.future.set_result(list(owner.completions))

    def _retry(self, server: _Server, job: _Job, failure: str) -> None:
        self._server_failed(server, failure)
        server.retries += 1
        job.failures.append(f"{server.url}: {failure}")
        job.failed_on.add(server.url)
        if len(job.failures) > self.max_retries:
            attempts = "; ".join(job.failures)
            error = f"a request failed {len(job.failures)} times, last on {server.url}: {attempts}"
            self._settle_error(job.owner, LLMServerError(error))
        else:
            self._queue.appendleft(job)

    def _server_failed(self, server: _Server, failure: str) -> None:
        server.failures += 1
        server.last_failure = failure
        if server.window is not None:
            server.window.failed()
        backoff = min(MAX_BACKOFF_S, self.retry_backoff * 2 ** min(server.failures - 1, 10))
        server.ready_at = asyncio.get_running_loop().time() + backoff

    @staticmethod
    def _settle_error(owner: _Prompt, error: Exception) -> None:
        if not owner.future.done():
            if not owner.started:
                owner.started = owner.future.set_running_or_notify_cancel()
                if not owner.started:
                    return
            owner.future.set_exception(error)

    def _body(
        self, prompt: Prompt, params: SamplingParams, first_sample: int, n: int, vllm: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if n > 1:
            body["n"] = n
            if vllm:  # each sample's token count (vLLM's usage sums them)
                body["return_token_ids"] = True
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed + first_sample
        if not is_chat(prompt):
            body["prompt"] = prompt
            return body
        body["messages"] = [dict(m) for m in prompt]
        if body["messages"] and body["messages"][-1].get("role") == "assistant":
            body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    def _completions(self, answer: dict[str, Any], owner: _Prompt, asked: int) -> list[Completion]:
        """The answer's choices (at most `asked`) as completions, in sample order, each with its
        token count: `token_ids`, else the tokenizer, else `usage` split and flagged."""
        choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))[:asked]
        if not choices:
            raise ValueError("choices")
        usage = answer["usage"]
        completions = [_completion(choice, owner, usage["prompt_tokens"]) for choice in choices]
        estimated = False
        if len(choices) == 1:
            counts = [usage["completion_tokens"]]
        elif all(c.get("token_ids") is not None for c in choices):
            counts = [len(c["token_ids"]) for c in choices]
        elif self._tokenizer is not None:
            counts = [_count_tokens(self._tokenizer, c) for c in completions]
        else:
            counts = split_count(usage["completion_tokens"], [len(c.text) for c in completions])
            estimated = True
        return [
            replace(c, completion_tokens=k, tokens_estimated=estimated)
            for c, k in zip(completions, counts, strict=True)
        ]


def split_count(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights` (evenly when they are all 0), as whole numbers
    that add up to it (largest remainders)."""
    weights = [w + 1 for w in weights]  # a choice with no text still cost a token (EOS)
    shares = [total * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _completion(choice: dict, owner: _Prompt, prompt_tokens: int) -> Completion:
    """A choice as a completion; its token count is set by the caller."""
    text = choice["message"]["content"] if is_chat(owner.prompt) else choice["text"]
    text, stop_string = truncate_at_stop(text or "", owner.params.stop)
    reason = choice.get("finish_reason")
    if stop_string is None and reason == "stop" and isinstance(choice.get("stop_reason"), str):
        # vLLM strips the stop string from the text and names it here.
        stop_string = choice["stop_reason"]
    if stop_string is not None:
        finish = "stop"
    else:
        finish = "length" if reason == "length" else "eos"
    return Completion(text, finish, stop_string, prompt_tokens, 0)


def _local_tokenizer(model: str | None) -> Any:
    """The served model's tokenizer where it is on this machine (a directory, or the Hugging
    Face cache), else None; never downloaded (a served name need not be a hub id)."""
    if not model:
        return None
    try:
        from pathlib import Path

        if not Path(model, "tokenizer_config.json").is_file():
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(model, "tokenizer_config.json"), str):
                return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:  # any failure to load means: count another way
        return None


def _count_tokens(tokenizer: Any, completion: Completion) -> int:
    """Tokens the model generated for `completion`: its text, the stop string it ended on, and
    the end-of-sequence token."""
    text = completion.text + (completion.stop_string or "")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return len(ids) + (completion.finish_reason == "eos")


def _report(server: _Server, now: float) -> dict[str, float]:
    span = (server.last_answer or now) - (server.first_sent or now)
    return {
        "window": server.window.limit if server.window is not None else 0,
        "requests": server.requests,
        "sequences": server.sequences,
        "tokens": server.tokens,
        "tokens_per_s": server.tokens / span if span > 0 else 0.0,
        "retries": server.retries,
        "failures": server.failures,
        "in_flight": server.in_flight,
    }


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, LLMServerError) else repr(exc)
