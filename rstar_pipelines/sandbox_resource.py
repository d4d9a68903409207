"""The Dagster resource that hands assets a running sandbox pool."""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from rstar_pipelines import progress


class SandboxResource(dg.ConfigurableResource):
    """`sandbox.get()` returns a started `rstar_sandbox.Sandbox`; it starts on first use
    (assets that run no code start no containers) and stops when the step ends.

    Unset fields fall back to RSTAR_SANDBOX_BACKEND (default "auto": Docker when an
    engine answers and the sandbox image is built, else the process backend; "http"
    when RSTAR_SANDBOX_URLS names sandbox services) and RSTAR_SANDBOX_WORKERS
    (default: the number of CPUs; for "http", the batches in flight at once).

    `urls` (or RSTAR_SANDBOX_URLS, comma-separated) points the pipeline at `rstar
    sandbox serve` instances or a load balancer in front of them; their bearer token
    comes from RSTAR_SANDBOX_TOKEN."""

    backend: str | None = None
    workers: int | None = None
    image: str | None = None
    preload: list[str] = Field(default_factory=lambda: ["numpy"])
    urls: list[str] = Field(default_factory=list)

    _sandbox = PrivateAttr(default=None)

    def backend_name(self) -> str:
        """The backend `get` starts (a training process starts its own sandbox with it)."""
        if self.backend:
            return self.backend
        if "RSTAR_SANDBOX_BACKEND" in os.environ:
            return os.environ["RSTAR_SANDBOX_BACKEND"]
        return "http" if self.service_urls() else "auto"

    def service_urls(self) -> list[str]:
        from rstar_sandbox.http_client import urls_from_env

        return list(self.urls) or urls_from_env()

    def worker_count(self) -> int | None:
        """The workers `get` starts; None: the sandbox's default (the number of CPUs)."""
        return self.workers or int(os.environ.get("RSTAR_SANDBOX_WORKERS", 0)) or None

    def get(self):
        from rstar_sandbox import Sandbox

        if self._sandbox is None:
            backend = self.backend_name()
            if backend == "http":
                sandbox = Sandbox(
                    backend="http", workers=self.worker_count(), urls=self.service_urls()
                )
            else:
                sandbox = Sandbox(
                    backend=backend,
                    workers=self.worker_count(),
                    image=self.image,
                    preload=tuple(self.preload),
                )
            sandbox.start()
            # Its jobs go to the running step's progress (progress.py).
            self._sandbox = CountingSandbox(sandbox)
        return self._sandbox

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


class CountingSandbox:
    """A sandbox that reports the jobs of each `run` call to the running step's progress."""

    def __init__(self, sandbox: Any):
        self._sandbox = sandbox

    def run(self, jobs: Any, *args: Any, **kwargs: Any) -> Any:
        results = self._sandbox.run(jobs, *args, **kwargs)
        progress.count(sandbox_jobs=len(results))
        return results

    def stream(self, jobs: Any) -> Any:
        """The sandbox's `stream`, each job counted as it finishes (a streamed stage
        advances its progress between jobs, so its lines carry the jobs' rate)."""
        for finished in self._sandbox.stream(jobs):
            progress.count(sandbox_jobs=1)
            yield finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sandbox, name)
