"""Sandboxes over the real one: one that records its calls, one that runs each program once."""

from __future__ import annotations

from rstar_sandbox import Job, Sandbox


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
