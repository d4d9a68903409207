"""Sandboxes for tests: which backends run here, sandboxes over the real one (one that records
its calls, one that records how much its streams hold, one that runs each program once), one
that runs nothing until told to, and an asset that runs jobs through the sandbox resource."""

from __future__ import annotations

import os
import threading

import dagster as dg
import pytest

from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_sandbox import OK, Job, Result, Sandbox, docker_available


def require_backend(backend: str) -> None:
    """Docker tests run wherever an engine answers, and must run in CI."""
    if backend == "docker" and not docker_available():
        if os.environ.get("CI"):
            pytest.fail("CI must run the Docker sandbox tests, but no Docker engine answers")
        pytest.skip("no Docker engine answers here")
    if backend == "process" and os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"):
        pytest.skip("the process backend needs root or user namespaces")


def has_lean_zygote(backend: str) -> bool:
    """Whether a worker runs stdlib-only jobs in a zygote without numpy: where its jobs
    run as a uid of their own (Docker; the process backend when started as root)."""
    return backend == "docker" or os.geteuid() == 0


@dg.asset
def sums(sandbox: SandboxResource) -> dg.MaterializeResult:
    """Two sums run in the sandbox of the step's resource; their outputs as metadata."""
    results = sandbox.get().run_many("print(sum(map(int, input().split())))", ["1 2\n", "3 4\n"])
    return dg.MaterializeResult(metadata={"outputs": [r.stdout.strip() for r in results]})


class CountingSandbox:
    """Runs jobs in `sandbox` and records the jobs of every `run` call in `batches`."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.batches: list[list[Job]] = []

    @property
    def runs(self) -> int:
        return len(self.batches)

    def run(self, jobs):
        self.batches.append(list(jobs))
        return self.sandbox.run(jobs)


class WindowedSandbox:
    """Streams jobs through `sandbox`, recording the jobs of every `stream` call and the most
    jobs queued and not yet handed back at any one time."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.calls: list[int] = []
        self.queued = 0
        self.most_queued = 0

    def stream(self, jobs):
        self.calls.append(len(jobs))
        self.queued += len(jobs)
        self.most_queued = max(self.most_queued, self.queued)
        return self._handed(self.sandbox.stream(jobs))

    def _handed(self, pairs):
        for pair in pairs:
            self.queued -= 1
            yield pair


class MemoSandbox:
    """The sandbox, each program run once: a search replayed in every order runs the same
    programs over and over."""

    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.results: dict[str, object] = {}

    def run(self, jobs):
        new = [job for job in jobs if job.code not in self.results]
        self.results.update(
            (job.code, r) for job, r in zip(new, self.sandbox.run(new), strict=True)
        )
        return [self.results[job.code] for job in jobs]


class GatedSandbox:
    """A sandbox whose runs all wait for `gate`; each job's result echoes its input."""

    backend, workers = "gated", 1

    def __init__(self):
        self.gate = threading.Event()
        self.ran: list[Job] = []

    def run(self, jobs):
        assert self.gate.wait(30), "the gate never opened"
        self.ran.extend(jobs)
        return [Result(OK, 0, job.stdin, "", 0.0, 0.0, 0.0) for job in jobs]

    def stream(self, jobs):
        return enumerate(self.run(jobs))
