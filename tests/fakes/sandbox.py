"""Sandboxes over the real one (one that records its calls, one that runs each program once),
and one that runs nothing until told to."""

from __future__ import annotations

import threading

from rstar_sandbox import OK, Job, Result, Sandbox


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
