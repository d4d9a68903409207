"""rstar_sandbox: run untrusted Python programs in warm, locked-down workers.

    from rstar_sandbox import Sandbox, Job
    with Sandbox(backend="docker", workers=4) as sb:
        results = sb.run([Job(code=src, stdin="1 2\\n", timeout_s=2.0, memory_mb=256)])
        outputs = sb.run_many(code=src, stdins=["1 2\\n", "3 4\\n"], timeout_s=2.0)

Backends: "docker" (a pool of containers, each running `server.py`), "process" (the
same server as host processes in fresh namespaces, for machines without an engine),
"auto" (Docker when an engine answers and the image is built), "http" (the same API
over `rstar sandbox serve` instances on other hosts: `Sandbox(backend="http",
urls=[...])`, see http_client and service); others register in
`rstar_sandbox.pool.BACKENDS`. On docker and process, nothing a job writes or starts
survives it and no job can read another's data (see server.py). This package never imports
rstar_pipelines or Dagster.
"""

from rstar_sandbox.jobs import (
    MEMORY_LIMIT,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    STATUSES,
    TIMEOUT,
    Job,
    Result,
)
from rstar_sandbox.pool import Sandbox, docker_available

__all__ = [
    "MEMORY_LIMIT",
    "OK",
    "OUTPUT_LIMIT",
    "RUNTIME_ERROR",
    "SANDBOX_ERROR",
    "STATUSES",
    "TIMEOUT",
    "Job",
    "Result",
    "Sandbox",
    "docker_available",
]
