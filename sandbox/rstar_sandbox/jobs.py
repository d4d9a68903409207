"""Jobs and results: what the host sends to the sandbox server and what comes back."""

from __future__ import annotations

from dataclasses import dataclass

from rstar_sandbox import server

OK = server.OK
RUNTIME_ERROR = server.RUNTIME_ERROR
TIMEOUT = server.TIMEOUT
MEMORY_LIMIT = server.MEMORY_LIMIT
OUTPUT_LIMIT = server.OUTPUT_LIMIT
SANDBOX_ERROR = server.SANDBOX_ERROR
STATUSES = (OK, RUNTIME_ERROR, TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, SANDBOX_ERROR)

# Where a batch of jobs goes over HTTP: the sandbox service (service.py) serves it, the
# client (http_client.py) posts to it.
BATCH_PATH = "/v1/batches"
BATCH_ID_HEADER = "X-Rstar-Batch"  # the id again, as a header a load balancer can hash on


@dataclass(frozen=True)
class Job:
    """One Python program to run on one input."""

    code: str
    stdin: str = ""
    timeout_s: float = 10.0
    memory_mb: int = 256
    output_limit_bytes: int = 1 << 20
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 256

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.output_limit_bytes <= 0:
            raise ValueError(f"job limits must be positive: {self}")

    def request(self, request_id: int) -> dict:
        # Its fields are plain values: no need for asdict's deep copy, once per job.
        return {"id": request_id, **vars(self)}


@dataclass(frozen=True)
class Result:
    """What happened: `status` is one of STATUSES; stdout/stderr are capped."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_memory_mb: float
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def from_reply(cls, reply: dict, attempts: int = 1) -> Result:
        return cls(
            status=reply["status"],
            exit_code=reply.get("exit_code"),
            stdout=reply.get("stdout", ""),
            stderr=reply.get("stderr", ""),
            wall_s=reply.get("wall_s", 0.0),
            cpu_s=reply.get("cpu_s", 0.0),
            peak_memory_mb=reply.get("peak_memory_mb", 0.0),
            attempts=attempts,
        )

    @classmethod
    def sandbox_error(cls, message: str, attempts: int) -> Result:
        return cls(SANDBOX_ERROR, None, "", message, 0.0, 0.0, 0.0, attempts)
