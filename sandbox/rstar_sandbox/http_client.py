"""`Sandbox(backend="http", urls=[...])`: jobs run by `rstar sandbox serve` instances.

The jobs of a `run` (or `stream`) call go out in batches, each with an id of its own,
spread over the URLs (several services, or one load balancer in front of them), over
persistent connections, in the compact framing (jobs.encode_batch); each service streams
a batch's results back as its jobs finish. Every job gets exactly one result:
  * 429 (queue full): wait as `Retry-After` says, then send the same batch again;
  * connection refused, 502/503 (nothing ran there): send it to the next URL;
  * the connection dropped or timed out mid-batch: ask the same URL again with the same
    id: a live service answers from the run it already made ("replayed"), so nothing
    runs twice; only when that host has died (refused, or a load balancer's 502/503)
    does the batch run again on another host, and the results not yet received count
    that attempt (those received before the drop stand, and are not given twice);
  * no service answers before the deadline: each job of the batch gets a
    `sandbox_error` result saying so.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import httpx

from rstar_sandbox.jobs import (
    BATCH_ID_HEADER,
    BATCH_PATH,
    REPLAYED_HEADER,
    STREAM_TYPE,
    Job,
    Result,
    encode_batch,
    parse_result_line,
)

log = logging.getLogger("rstar_sandbox.http")
URLS_ENV = "RSTAR_SANDBOX_URLS"
TOKEN_ENV = "RSTAR_SANDBOX_TOKEN"
GRACE_S = 30.0  # beyond the batch's own timeouts, before a batch counts as stuck
MAX_BACKOFF_S = 10.0


def urls_from_env() -> list[str]:
    return [u.strip() for u in os.environ.get(URLS_ENV, "").split(",") if u.strip()]


class _HostDied(Exception):
    """Nothing answers at a URL (or the load balancer in front has no live backend)."""


@dataclass
class _Batch:
    """One batch's sends and what became of them: `unanswered`, one may have run where no
    whole answer came back from; `lost`, runs known to have died with their host (a later
    answer ran the batch afresh instead of replaying that run); `settle` hands each job's
    result on, once, whichever send it came from."""

    jobs: list[Job]
    deliver: Callable[[int, Result], None]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    unanswered: bool = False
    lost: int = 0
    settled: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.body = encode_batch(self.id, self.jobs)
        self.read_timeout = sum(j.timeout_s for j in self.jobs) + GRACE_S

    def settle(self, index: int, result: Result) -> None:
        if index in self.settled:
            return
        if not 0 <= index < len(self.jobs):
            raise RuntimeError(f"a result for job {index} of a batch of {len(self.jobs)}")
        self.settled.add(index)
        self.deliver(index, replace(result, attempts=result.attempts + self.lost))


class HttpSandbox:
    """The `Sandbox` API over sandbox services (see the module docstring)."""

    backend = "http"

    def __init__(
        self,
        workers: int | None = None,
        *,
        urls: Sequence[str] | None = None,
        token: str | None = None,
        batch_size: int = 32,
        deadline_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        **_pool_options,  # image, preload, ...: the services' own settings, not the client's
    ):
        self.urls = [u.rstrip("/") for u in (urls or urls_from_env())]
        if not self.urls:
            raise ValueError(f"the http sandbox backend needs urls (or {URLS_ENV})")
        # In flight at once: enough batches to keep every service busy.
        self.workers = workers or 4 * len(self.urls)
        self.batch_size = batch_size
        self.deadline_s = deadline_s
        self.connect_timeout_s = connect_timeout_s
        token = token or os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._next_url = itertools.count()
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stats_lock = threading.Lock()
        self.stats = {"batches": 0, "backoffs": 0, "failovers": 0}

    def __enter__(self) -> HttpSandbox:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        limits = httpx.Limits(max_connections=self.workers, max_keepalive_connections=self.workers)
        self._client = httpx.Client(headers=self._headers, limits=limits)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="rstar-sandbox-http")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def health(self) -> list[dict]:
        """Each URL's /health answer (or the error reaching it)."""
        out = []
        for url in self.urls:
            try:
                out.append(httpx.get(f"{url}/health", timeout=self.connect_timeout_s).json())
            except httpx.HTTPError as err:
                out.append({"status": "unreachable", "url": url, "error": str(err)})
        return out

    def run(self, jobs: Sequence[Job]) -> list[Result]:
        """Run the jobs; results come back in job order. Safe to call from many threads."""
        results: list[Result | None] = [None] * len(jobs)
        for index, result in self.stream(jobs):
            results[index] = result
        return results  # type: ignore[return-value]

    def run_many(self, code: str, stdins: Sequence[str], **limits) -> list[Result]:
        """One program over many inputs."""
        return self.run([Job(code=code, stdin=stdin, **limits) for stdin in stdins])

    def stream(self, jobs: Sequence[Job]) -> Iterator[tuple[int, Result]]:
        """(index, result) for every job, once, as each finishes; the batches are sent at
        the call. Safe to call from many threads."""
        if self._pool is None:
            raise RuntimeError("the sandbox is not running: use `with Sandbox(...) as sb:`")
        finished: queue.SimpleQueue = queue.SimpleQueue()
        for start in range(0, len(jobs), self.batch_size):
            chunk = list(jobs[start : start + self.batch_size])
            self._pool.submit(self._run_batch, chunk, start, finished.put)
        return self._collect(finished, len(jobs))

    @staticmethod
    def _collect(finished: queue.SimpleQueue, count: int) -> Iterator[tuple[int, Result]]:
        for _ in range(count):
            index, result = finished.get()
            if isinstance(result, BaseException):  # a batch the services refused
                raise result
            yield index, result

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def _run_batch(self, jobs: list[Job], offset: int, put: Callable) -> None:
        batch = _Batch(jobs, lambda i, result: put((offset + i, result)))
        try:
            self._send_batch(batch)
        except Exception as err:
            put((offset, err))

    def _send_batch(self, batch: _Batch) -> None:
        deadline = time.monotonic() + self.deadline_s
        start = next(self._next_url)
        last_error = "no attempt made"
        for turn in itertools.count():
            url = self.urls[(start + turn) % len(self.urls)]
            try:
                return self._run_at(url, batch, deadline)
            except _HostDied as err:
                last_error = str(err)
                self._count("failovers")
                log.warning("sandbox service %s is down (%s); trying the next", url, err)
            except TimeoutError:
                break
            if (turn + 1) % len(self.urls) == 0:  # every URL tried: give them a moment
                time.sleep(min(0.2 * (turn + 1), MAX_BACKOFF_S))
            if time.monotonic() > deadline:
                break
        message = f"no sandbox service answered within {self.deadline_s:.0f} s: {last_error}"
        for index in range(len(batch.jobs)):
            batch.settle(index, Result.sandbox_error(message, 1))

    def _run_at(self, url: str, batch: _Batch, deadline: float) -> None:
        """The batch's results from one URL, asking again while that host is alive."""
        backoff = 0.1
        while time.monotonic() < deadline:
            try:
                with self._post(url, batch) as reply:
                    wait = self._take(url, reply, batch)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                raise _HostDied(f"{url}: {err}") from None
            except (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError):
                # The batch may be running there: ask again with the same id, and the
                # service answers from that run (or the next try finds the host dead).
                batch.unanswered = True
                time.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            if wait is None:
                return
            time.sleep(wait)
        raise TimeoutError

    def _take(self, url: str, reply: httpx.Response, batch: _Batch) -> float | None:
        """Settle the batch from a reply as its lines come; None once every job has its
        result, else how long to wait before asking again."""
        if reply.status_code == 200:
            if batch.unanswered and reply.headers.get(REPLAYED_HEADER) != "1":
                batch.lost += 1  # that send's run died with its host: this one re-ran it
            rest = b""
            for data in reply.iter_bytes():  # whole lines, as many as have come
                *lines, rest = (rest + data).split(b"\n")
                for line in lines:
                    batch.settle(*parse_result_line(line))
            if len(batch.settled) != len(batch.jobs):
                missing = len(batch.jobs) - len(batch.settled)
                raise RuntimeError(f"{url}: no result for {missing} of {len(batch.jobs)} jobs")
            self._count("batches")
            return None
        if reply.status_code == 429:
            self._count("backoffs")
            wait = float(reply.headers.get("Retry-After", 0.1))
            return wait * random.uniform(1.0, 1.5)  # jitter: no thundering herd
        if reply.status_code == 502:  # a load balancer lost the host mid-batch
            batch.unanswered = True
            raise _HostDied(f"{url}: HTTP 502")
        if reply.status_code == 503:  # no host behind it, or it is shutting down
            raise _HostDied(f"{url}: HTTP 503")
        if reply.status_code == 504:  # the load balancer gave up waiting: ask again
            batch.unanswered = True
            return 0.0
        reply.read()
        raise RuntimeError(f"{url} refused the batch: {reply.status_code} {reply.text}")

    def _post(self, url: str, batch: _Batch):
        assert self._client is not None
        return self._client.stream(
            "POST",
            f"{url}{BATCH_PATH}",
            content=batch.body,
            headers={
                BATCH_ID_HEADER: batch.id,
                "Accept": STREAM_TYPE,
                "Content-Type": "application/json",
            },
            timeout=httpx.Timeout(batch.read_timeout, connect=self.connect_timeout_s),
        )
