"""The host-side pool: N warm workers, a bounded job queue, results in job order.

Every job ends with exactly one result. A worker that dies or stops answering is
replaced; the job it was running is retried once on the new worker and reported as
`sandbox_error` if that fails too.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from rstar_sandbox.jobs import Job, Result
from rstar_sandbox.workers import DockerWorker, ProcessWorker, Worker, WorkerDied

log = logging.getLogger("rstar_sandbox")
MAX_ATTEMPTS = 2


@dataclass
class _Batch:
    """The jobs of one `run` call: taken one at a time as workers free up, so nothing is
    queued ahead of the workers (back-pressure) and concurrent callers take turns."""

    jobs: Sequence[Job]
    results: list[Result | None]
    remaining: int
    taken: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: queue.SimpleQueue | None = None  # (index, result) as each job ends: `stream`

    def settle(self, index: int, result: Result) -> None:
        with self.lock:
            if self.results[index] is not None:  # never two results for one job
                return
            self.results[index] = result
            self.remaining -= 1
            if self.finished is not None:
                self.finished.put((index, result))
            if self.remaining == 0:
                self.done.set()


def docker_client():
    import docker

    return docker.from_env()


def docker_available() -> bool:
    try:
        return bool(docker_client().ping())
    except Exception:  # no SDK config, no socket, engine down: all mean "not available"
        return False


@dataclass(frozen=True)
class WorkerSettings:
    """What a backend needs to start workers; not every backend uses every field."""

    image: str | None
    preload: tuple[str, ...]
    memory_mb: int  # per worker (a container's memory cgroup)
    pids: int
    cpus: float
    tmpfs_mb: int
    start_timeout_s: float


def _docker_workers(settings: WorkerSettings) -> Callable[[int], Worker]:
    from rstar_sandbox.image import default_image, require_image
    from rstar_sandbox.workers import remove_orphaned_containers

    client = docker_client()
    image = settings.image or default_image()
    require_image(client, image)
    remove_orphaned_containers(client)
    return lambda i: DockerWorker(
        client,
        image,
        i,
        preload=settings.preload,
        memory_mb=settings.memory_mb,
        pids=settings.pids,
        cpus=settings.cpus,
        tmpfs_mb=settings.tmpfs_mb,
        start_timeout_s=settings.start_timeout_s,
    )


def _process_workers(settings: WorkerSettings) -> Callable[[int], Worker]:
    return lambda i: ProcessWorker(
        i,
        preload=settings.preload,
        tmpfs_mb=settings.tmpfs_mb,
        start_timeout_s=settings.start_timeout_s,
    )


# Backend name -> from the pool's settings, the function that starts worker i. A worker
# is anything with `execute(request, timeout_s) -> reply`, `kill()` and `close()` (see
# workers.Worker); a new backend registers here and the pool drives it like the others.
BACKENDS: dict[str, Callable[[WorkerSettings], Callable[[int], Worker]]] = {
    "docker": _docker_workers,
    "process": _process_workers,
}


def register_backend(
    name: str, start_workers: Callable[[WorkerSettings], Callable[[int], Worker]]
) -> None:
    if name == "auto":
        raise ValueError("'auto' picks a backend; it cannot be registered")
    BACKENDS[name] = start_workers


def _auto_backend(image: str | None) -> str:
    """Docker when an engine answers and the image is there, else the process backend."""
    if not docker_available():
        return "process"
    from rstar_sandbox.image import default_image

    image = image or default_image()
    try:
        docker_client().images.get(image)
    except Exception:  # ImageNotFound, or the engine stopped answering
        log.warning(
            "rstar_sandbox: a Docker engine answers but image %s is not built "
            "(`rstar sandbox build-image`); using the process backend",
            image,
        )
        return "process"
    return "docker"


class Sandbox:
    """Run untrusted Python programs in a pool of warm, locked-down workers.

    >>> with Sandbox(backend="docker", workers=4) as sb:
    ...     results = sb.run([Job(code=src, stdin="1 2\\n", timeout_s=2.0)])
    ...     outputs = sb.run_many(code=src, stdins=["1 2\\n", "3 4\\n"], timeout_s=2.0)
    """

    def __new__(cls, backend: str = "auto", *args, **kwargs):
        # "http": the same API over `rstar sandbox serve` instances (rstar_sandbox.http_client).
        if backend == "http":
            from rstar_sandbox.http_client import HttpSandbox

            return HttpSandbox(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        backend: str = "auto",
        workers: int | None = None,
        *,
        image: str | None = None,
        preload: Sequence[str] = ("numpy",),
        container_memory_mb: int = 1024,
        container_pids: int = 128,
        container_cpus: float = 1.0,
        tmpfs_mb: int = 64,
        grace_s: float = 10.0,
        start_timeout_s: float = 60.0,
    ):
        if backend == "auto":
            backend = _auto_backend(image)
        if backend not in BACKENDS:
            names = ", ".join([*BACKENDS, "http", "auto"])
            raise ValueError(f"unknown sandbox backend {backend!r}: use {names}")
        self.backend = backend
        self.workers = workers or os.cpu_count() or 1
        self.grace_s = grace_s
        self._ids = itertools.count()
        self._pending: deque[_Batch] = deque()  # batches with jobs not yet taken
        self._ready = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._live: dict[int, Worker] = {}
        self._closed = False
        self._new_worker = BACKENDS[backend](
            WorkerSettings(
                image=image,
                preload=tuple(preload),
                memory_mb=container_memory_mb,
                pids=container_pids,
                cpus=container_cpus,
                tmpfs_mb=tmpfs_mb,
                start_timeout_s=start_timeout_s,
            )
        )

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start every worker (in parallel: container start-up is mostly waiting)."""
        errors: list[BaseException] = []

        def start_one(index: int) -> None:
            try:
                self._live[index] = self._new_worker(index)
            except BaseException as err:
                errors.append(err)

        starters = [threading.Thread(target=start_one, args=(i,)) for i in range(self.workers)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        atexit.register(self.close)
        if errors:
            self.close()
            raise errors[0]
        for index in range(self.workers):
            thread = threading.Thread(
                target=self._serve, args=(index,), daemon=True, name=f"rstar-sandbox-{index}"
            )
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop the workers and remove their containers; safe to call more than once."""
        if self._closed:
            return
        with self._ready:
            self._closed = True
            abandoned, self._pending = list(self._pending), deque()
            self._ready.notify_all()
        for batch in abandoned:
            for index in range(batch.taken, len(batch.jobs)):
                batch.settle(index, Result.sandbox_error("the sandbox was closed", 0))
        for thread in self._threads:
            thread.join(timeout=30)
        for worker in list(self._live.values()):
            worker.close()
        self._live.clear()
        atexit.unregister(self.close)

    # -- running jobs ------------------------------------------------------------------

    def run(self, jobs: Sequence[Job]) -> list[Result]:
        """Run the jobs; results come back in job order. Safe to call from many threads."""
        if self._closed or not self._threads:
            raise RuntimeError("the sandbox is not running: use `with Sandbox(...) as sb:`")
        if not jobs:
            return []
        batch = self._submit(jobs, None)
        batch.done.wait()
        return batch.results  # type: ignore[return-value]

    def stream(self, jobs: Sequence[Job]) -> Iterator[tuple[int, Result]]:
        """(index, result) for every job, once, as each finishes: a caller can use the
        first results while the last jobs run. The jobs are queued at the call, not at the
        first `next`. Safe to call from many threads."""
        if self._closed or not self._threads:
            raise RuntimeError("the sandbox is not running: use `with Sandbox(...) as sb:`")
        finished: queue.SimpleQueue = queue.SimpleQueue()
        if jobs:
            self._submit(jobs, finished)
        return (finished.get() for _ in range(len(jobs)))

    def _submit(self, jobs: Sequence[Job], finished: queue.SimpleQueue | None) -> _Batch:
        batch = _Batch(jobs, [None] * len(jobs), len(jobs), finished=finished)
        with self._ready:
            self._pending.append(batch)
            self._ready.notify(min(len(jobs), self.workers))
        return batch

    def run_many(self, code: str, stdins: Sequence[str], **limits) -> list[Result]:
        """One program over many inputs."""
        return self.run([Job(code=code, stdin=stdin, **limits) for stdin in stdins])

    def live_workers(self) -> list[Worker]:
        """The workers now running (for benchmarks and drills)."""
        return list(self._live.values())

    def kill_worker(self, index: int) -> None:
        """Kill one worker's server abruptly, as a crash would (for tests and drills)."""
        self._live[index].kill()

    def _take(self) -> tuple[_Batch, int] | None:
        """The next job, round-robin over the waiting batches; None once closed."""
        with self._ready:
            while not self._pending and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            batch = self._pending.popleft()
            index = batch.taken
            batch.taken += 1
            if batch.taken < len(batch.jobs):
                self._pending.append(batch)
            return batch, index

    def _serve(self, index: int) -> None:
        while (taken := self._take()) is not None:
            batch, job_index = taken
            job = batch.jobs[job_index]
            for attempt in range(1, MAX_ATTEMPTS + 1):
                request = job.request(next(self._ids))
                try:
                    reply = self._live[index].execute(request, job.timeout_s + self.grace_s)
                except WorkerDied as err:
                    log.warning("%s (job attempt %d of %d)", err, attempt, MAX_ATTEMPTS)
                    replaced = self._replace(index)
                    if replaced and attempt < MAX_ATTEMPTS:
                        continue
                    reason = str(err) if replaced else f"{err}; no replacement worker could start"
                    batch.settle(job_index, Result.sandbox_error(reason, attempt))
                else:
                    batch.settle(job_index, Result.from_reply(reply, attempt))
                break

    def _replace(self, index: int) -> bool:
        self._live[index].close()
        try:
            self._live[index] = self._new_worker(index)
            return True
        except Exception as err:
            log.error("rstar_sandbox: cannot replace worker %d: %s", index, err)
            return False
