"""Jobs and results: what the host sends to the sandbox server and what comes back."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

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
# A request that accepts STREAM_TYPE gets its results as they finish: one `result_line` per
# job, in finishing order; REPLAYED_HEADER says whether they come from an earlier run.
STREAM_TYPE = "application/x-ndjson"
REPLAYED_HEADER = "X-Rstar-Replayed"


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


_LIMITS = {f.name: f.default for f in fields(Job) if f.name != "code"}


def encode_batch(batch_id: str, jobs: list[Job]) -> bytes:
    """A batch as the service reads it, compactly: each program once (jobs name it by its
    index in `programs`), and of each job's other fields only those off their defaults."""
    programs: dict[str, int] = {}
    specs = []
    for job in jobs:
        spec: dict = {"program": programs.setdefault(job.code, len(programs))}
        for name, default in _LIMITS.items():
            value = getattr(job, name)
            if value != default:
                spec[name] = value
        specs.append(spec)
    return json.dumps({"id": batch_id, "programs": list(programs), "jobs": specs}).encode()


def result_line(index: int, r: Result) -> bytes:
    """One finished job of a streamed batch: its index and its result's fields, in order."""
    values = [index, r.status, r.exit_code, r.stdout, r.stderr, r.wall_s, r.cpu_s]
    return (json.dumps([*values, r.peak_memory_mb, r.attempts]) + "\n").encode()


def parse_result_line(line: str | bytes) -> tuple[int, Result]:
    index, *values = json.loads(line)
    return index, Result(*values)
