"""`rstar sandbox serve`: one host's sandbox pool behind HTTP, for pipelines on other hosts.

    POST /v1/batches   {"id": "<batch id>", "jobs": [{"code": ..., "stdin": ..., ...}]}
        or, compactly, each program once: {"id": ..., "programs": [code, ...],
        "jobs": [{"program": <index into programs>, "stdin": ..., ...}]}
        200  with `Accept: application/x-ndjson`: one line per job as it finishes,
             [job index, status, exit_code, stdout, stderr, wall_s, cpu_s, peak_memory_mb,
             attempts] (jobs.result_line), the header X-Rstar-Replayed: 1 when they come
             from an earlier request's run of this id; otherwise {"id": ..., "replayed":
             bool, "results": [...]}, one result per job, in job order
        429  no room: the bounded queue is full and so is the waiting room beside it (as
             many jobs again), or the batch waited there ADMIT_WAIT_S; `Retry-After` says
             when to ask again (when the queue, at the recent rate, has room for it)
        400  a malformed body or job (the message names it), 401 without the token,
        409  a batch id reused for other jobs, 413 a batch larger than the whole queue
    GET /health        200 while serving (503 once shutting down): for load balancers
    GET /metrics       Prometheus text: jobs by status, batches, 429s, queue depth

Every batch carries an id chosen by the client. A batch the service has run, or is
running, is answered from that run when its id comes again (a client whose connection
dropped asks again and gets the same results): retries never run a job twice on a host
that is alive. The jobs themselves run on the public `Sandbox` API, so any backend works.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import math
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rstar_sandbox.jobs import (
    BATCH_PATH,
    REPLAYED_HEADER,
    STREAM_TYPE,
    Job,
    Result,
    result_line,
)
from rstar_sandbox.pool import Sandbox

log = logging.getLogger("rstar_sandbox.service")
MAX_BODY_BYTES = 256 << 20
REMEMBERED_BATCHES = 4096  # finished batches kept to answer a retry from the same run
RATE_WINDOW_S = 10.0  # the recent throughput that Retry-After is estimated from
# How long a batch that finds the queue full waits for room before a 429 (Retry-After's cap):
# a client told to come back would leave the workers idle once the queue drains (the pool
# takes batches round-robin, so they end together), where a batch held here starts as soon
# as there is room. A load balancer sends a retry of the same batch to the same service.
ADMIT_WAIT_S = 30.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def parse_batch(body: bytes) -> tuple[str, list[Job]]:
    """The batch id and its jobs; a RequestError naming what is wrong otherwise."""
    try:
        payload = json.loads(body)
    except ValueError as err:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {err}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("jobs"), list):
        raise RequestError(HTTPStatus.BAD_REQUEST, 'body must be {"id": str, "jobs": [...]}')
    batch_id = payload.get("id")
    if not isinstance(batch_id, str) or not batch_id:
        raise RequestError(HTTPStatus.BAD_REQUEST, "the batch needs a non-empty string 'id'")
    programs = payload.get("programs", [])
    if not isinstance(programs, list) or not all(isinstance(p, str) for p in programs):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'programs' must be a list of strings")
    jobs = []
    for index, spec in enumerate(payload["jobs"]):
        try:
            jobs.append(Job(**_job_fields(spec, programs)))
        except (TypeError, ValueError) as err:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"job {index}: {err}") from None
    return batch_id, jobs


def _job_fields(spec: Any, programs: list[str]) -> dict:
    """A job's fields, its code looked up when it names one of the batch's programs."""
    if not isinstance(spec, dict):
        raise ValueError("a job is an object with a string 'code' or an integer 'program'")
    if "program" in spec:
        spec = dict(spec)
        k = spec.pop("program")
        if type(k) is not int or not 0 <= k < len(programs) or "code" in spec:
            raise ValueError(f"'program' {k!r} is not one of the {len(programs)} programs")
        spec["code"] = programs[k]
    if not isinstance(spec.get("code"), str):
        raise ValueError("a job is an object with a string 'code' or an integer 'program'")
    return spec


@dataclass
class _Run:
    """One batch id's run: joined by any retry that arrives while it is going on."""

    digest: str
    done: threading.Event = field(default_factory=threading.Event)
    results: list[Result] | None = None


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Counter(
            "rstar_sandbox_jobs", "Jobs run, by status", ["status"], registry=self.registry
        )
        self.batches = Counter("rstar_sandbox_batches", "Batches run", registry=self.registry)
        self.replayed = Counter(
            "rstar_sandbox_batches_replayed",
            "Batches answered from an earlier run of the same id",
            registry=self.registry,
        )
        self.rejected = Counter(
            "rstar_sandbox_batches_rejected", "Batches answered 429", registry=self.registry
        )
        self.queued = Gauge(
            "rstar_sandbox_queued_jobs", "Jobs admitted and not finished", registry=self.registry
        )
        self.workers = Gauge("rstar_sandbox_workers", "Pool workers", registry=self.registry)
        self.batch_seconds = Histogram(
            "rstar_sandbox_batch_seconds", "Batch wall time", registry=self.registry
        )


class SandboxService:
    """The HTTP front of a started `Sandbox`: admission, idempotent batches, metrics."""

    def __init__(self, sandbox: Sandbox, *, max_queue: int | None = None, token: str | None = None):
        self.sandbox = sandbox
        self.max_queue = max_queue or 256 * sandbox.workers
        self.token = token
        self.metrics = _Metrics()
        self.metrics.workers.set(sandbox.workers)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified as batches finish
        self._queued = 0
        self._waiting = 0  # jobs of the batches waiting for room
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        # (finished, jobs, admitted) of recent batches, by monotonic time
        self._finished: deque[tuple[float, int, float]] = deque()
        self.serving = True

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        expected = f"Bearer {self.token}"
        return header is not None and hmac.compare_digest(header.encode(), expected.encode())

    def _admit(self, batch_id: str, digest: str, size: int) -> tuple[_Run, bool]:
        """The run that answers this batch, and whether this request must start it. A batch
        that finds the queue full waits for room (see ADMIT_WAIT_S) while the waiting room has
        room for it; a retry of its id that comes meanwhile joins whichever request gets in
        first."""
        if size > self.max_queue:
            raise RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"a batch of {size} jobs exceeds this service's queue of {self.max_queue}; "
                "send smaller batches",
            )
        deadline, waiting = time.monotonic() + ADMIT_WAIT_S, 0
        with self._lock:
            try:
                while (run := self._runs.get(batch_id)) is None:
                    if self._queued + size <= self.max_queue:
                        return self._start(batch_id, digest, size), True
                    if not self.serving:
                        raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "shutting down")
                    left = deadline - time.monotonic()
                    if left <= 0 or self._waiting - waiting + size > self.max_queue:
                        self.metrics.rejected.inc()
                        raise RequestError(
                            HTTPStatus.TOO_MANY_REQUESTS,
                            f"queue full ({self._queued} of {self.max_queue} jobs, "
                            f"{self._waiting - waiting} more waiting)",
                            {"Retry-After": str(self._room_seconds(size - waiting))},
                        )
                    self._waiting += size - waiting
                    waiting = size
                    self._room.wait(left)
            finally:
                self._waiting -= waiting
        if run.digest != digest:
            message = f"batch id {batch_id!r} was used for other jobs"
            raise RequestError(HTTPStatus.CONFLICT, message)
        self.metrics.replayed.inc()
        return run, False

    def stop(self) -> None:
        """Admit nothing more; the batches waiting for room are answered 503 (their clients
        send them elsewhere)."""
        with self._lock:
            self.serving = False
            self._room.notify_all()

    def _start(self, batch_id: str, digest: str, size: int) -> _Run:
        """Admit a batch (the lock held): its jobs counted in the queue, its run remembered."""
        self._queued += size
        self.metrics.queued.set(self._queued)
        run = self._runs[batch_id] = _Run(digest)
        while len(self._runs) > REMEMBERED_BATCHES:
            oldest = next(iter(self._runs))
            if not self._runs[oldest].done.is_set():
                break
            del self._runs[oldest]
        return run

    def run_batch(self, batch_id: str, jobs: list[Job], digest: str) -> tuple[list[Result], bool]:
        """The batch's results in job order, and whether they come from an earlier run."""
        pairs, replayed = self.stream_batch(batch_id, jobs, digest)
        results: list[Result | None] = [None] * len(jobs)
        for index, result in pairs:
            results[index] = result
        return results, replayed  # type: ignore[return-value]

    def stream_batch(
        self, batch_id: str, jobs: list[Job], digest: str
    ) -> tuple[Iterable[tuple[int, Result]], bool]:
        """(index, result) of every job, and whether they come from an earlier request's run
        (then all at once, when that run ends). The caller consumes every pair, whatever
        becomes of its client: the run is remembered for a retry only once it is whole."""
        run, starts = self._admit(batch_id, digest, len(jobs))
        if starts:
            return self._execute(batch_id, run, jobs), False
        run.done.wait()
        if run.results is None:
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the batch's run failed")
        return enumerate(run.results), True

    def _execute(self, batch_id: str, run: _Run, jobs: list[Job]) -> Iterator[tuple[int, Result]]:
        admitted, started = time.monotonic(), time.perf_counter()
        results: list[Result | None] = [None] * len(jobs)
        try:
            for index, result in self.sandbox.stream(jobs):
                results[index] = result
                self.metrics.jobs.labels(result.status).inc()
                yield index, result
            run.results = results  # type: ignore[assignment]
        except BaseException:
            with self._lock:  # let a retry start it afresh
                self._runs.pop(batch_id, None)
            raise
        finally:
            took = time.perf_counter() - started
            with self._lock:
                self._queued -= len(jobs)
                self.metrics.queued.set(self._queued)
                self._finished.append((time.monotonic(), len(jobs), admitted))
                self._room.notify_all()
            run.done.set()
        self.metrics.batches.inc()
        self.metrics.batch_seconds.observe(took)

    def _room_seconds(self, size: int) -> int:
        """Retry-After: how long, at the recent rate, until the queue has room for `size` more
        jobs (whole seconds, as HTTP has it; 1 while there is no rate to go by), at most 30.
        The rate is over the time the recent batches took from their admission: a service
        busy for less than the window is not taken for a slow one."""
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - RATE_WINDOW_S:
            self._finished.popleft()
        done = sum(n for _, n, _ in self._finished)
        if not done:
            return 1
        since = max(now - RATE_WINDOW_S, min(admitted for _, _, admitted in self._finished))
        excess = self._queued + self._waiting + size - self.max_queue
        return min(30, max(1, math.ceil(excess * (now - since) / done)))

    def drain(self, timeout_s: float = 300.0) -> None:
        """Wait for the admitted jobs to finish (their replies are on their way)."""
        deadline = time.monotonic() + timeout_s
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the last replies are being written

    def health(self) -> dict[str, Any]:
        with self._lock:
            queued, waiting = self._queued, self._waiting
        return {
            "status": "ok" if self.serving else "stopping",
            "workers": self.sandbox.workers,
            "backend": self.sandbox.backend,
            "queued_jobs": queued,
            "waiting_jobs": waiting,
            "max_queue": self.max_queue,
        }


def _handler(service: SandboxService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection carries many batches

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers=None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: HTTPStatus, payload: Any, headers=None) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json", headers)

        def _error(self, err: RequestError) -> None:
            self._json(err.status, {"error": str(err)}, err.headers)

        def do_GET(self) -> None:
            if self.path == "/health":
                status = HTTPStatus.OK if service.serving else HTTPStatus.SERVICE_UNAVAILABLE
                self._json(status, service.health())
            elif self.path == "/metrics":
                if not service.authorized(self.headers.get("Authorization")):
                    self._error(RequestError(HTTPStatus.UNAUTHORIZED, "a bearer token is needed"))
                    return
                body = generate_latest(service.metrics.registry)
                self._send(HTTPStatus.OK, body, "text/plain; version=0.0.4")
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no such path {self.path}"))

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if 0 < length <= MAX_BODY_BYTES else b""
            try:
                if self.path != BATCH_PATH:
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
                if not service.authorized(self.headers.get("Authorization")):
                    raise RequestError(HTTPStatus.UNAUTHORIZED, "a bearer token is needed")
                if length > MAX_BODY_BYTES:
                    raise RequestError(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes"
                    )
                if not service.serving:
                    raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "shutting down")
                batch_id, jobs = parse_batch(body)
                digest = hashlib.sha256(body).hexdigest()
                if STREAM_TYPE in (self.headers.get("Accept") or ""):
                    pairs, replayed = service.stream_batch(batch_id, jobs, digest)
                    self._stream(pairs, replayed)
                    return
                results, replayed = service.run_batch(batch_id, jobs, digest)
            except RequestError as err:
                self._error(err)
                return
            payload = {
                "id": batch_id,
                "replayed": replayed,
                "results": [asdict(r) for r in results],
            }
            self._json(HTTPStatus.OK, payload)

        def _stream(self, pairs: Iterable[tuple[int, Result]], replayed: bool) -> None:
            """Each result as an HTTP chunk as it comes. A client gone mid-batch stops the
            writing, not the run: its retry is answered from the whole run."""
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", STREAM_TYPE)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header(REPLAYED_HEADER, "1" if replayed else "0")
                self.end_headers()
                writing = True
            except OSError:
                self.close_connection, writing = True, False
            for index, result in pairs:
                if writing:
                    line = result_line(index, result)
                    writing = self._write(b"%x\r\n%s\r\n" % (len(line), line))
            if writing:
                self._write(b"0\r\n\r\n")

        def _write(self, data: bytes) -> bool:
            try:
                self.wfile.write(data)
                return True
            except OSError:
                self.close_connection = True
                return False

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: bursts of connections wait, not fail


def make_server(service: SandboxService, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for the service (not yet serving: call `serve_forever`)."""
    if not is_loopback(host) and service.token is None:
        raise ValueError(
            f"refusing to serve on {host}, beyond this machine, without a token: "
            "set RSTAR_SANDBOX_TOKEN (or --token-file)"
        )
    return _Server((host, port), _handler(service))


def serve(service: SandboxService, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; then answer 503 (load balancers stop sending),
    finish the batches under way and return."""
    server = make_server(service, host, port)

    def stop(signum, frame) -> None:
        service.stop()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.warning("rstar sandbox service on http://%s:%d", *server.server_address[:2])
    try:
        server.serve_forever(poll_interval=0.2)
        service.drain()
    finally:
        server.server_close()
