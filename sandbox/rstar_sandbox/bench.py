"""Throughput and latency of the sandbox, against two baselines.

Each client is a thread that submits one job at a time and waits for its result, as
an MCTS expansion or a verification step does; jobs/s is over all clients together.
Baselines: a `docker run --rm` per job, and a fresh host interpreter per job.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rstar_sandbox.jobs import Job
from rstar_sandbox.pool import Sandbox

TRIVIAL = "a, b = map(int, input().split())\nprint(a + b)\n"
TRIVIAL_STDIN = "1 2\n"


def _loop(n: int) -> str:
    return f"x = 0\nfor i in range({n}):\n    x += i * i\nprint(x % 1000)\n"


def cpu_bound_snippet(sb: Sandbox, target_s: float = 0.05) -> str:
    """A loop calibrated inside the sandbox (its interpreter) to take about `target_s` of CPU."""
    n = 1_000_000
    probe = (
        "import time\nstart = time.process_time()\n"
        + _loop(n)
        + "print(time.process_time() - start)\n"
    )
    [result] = sb.run([Job(code=probe, timeout_s=30.0)])
    took = float(result.stdout.split()[-1])
    return _loop(int(n * target_s / took))


@dataclass
class Measurement:
    system: str
    snippet: str
    clients: int
    jobs: int
    jobs_per_s: float
    p50_ms: float
    p99_ms: float
    failures: int

    def row(self) -> str:
        return (
            f"| {self.system} | {self.snippet} | {self.clients} | {self.jobs} | "
            f"{self.jobs_per_s:.0f} | {self.p50_ms:.1f} | {self.p99_ms:.1f} | {self.failures} |"
        )


HEADER = (
    "| system | snippet | clients | jobs | jobs/s | p50 ms | p99 ms | failed |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def _drive(run_one: Callable[[], bool], clients: int, jobs: int) -> tuple[float, list[float], int]:
    counter = itertools.count()
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def client() -> None:
        while next(counter) < jobs:
            start = time.perf_counter()
            ok = run_one()
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)
                failures[0] += not ok

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, latencies, failures[0]


def _measure(system: str, snippet: str, clients: int, jobs: int, run_one) -> Measurement:
    elapsed, latencies, failures = _drive(run_one, clients, jobs)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return Measurement(
        system,
        snippet,
        clients,
        len(latencies),
        len(latencies) / elapsed,
        statistics.median(latencies) * 1e3,
        p99 * 1e3,
        failures,
    )


def bench_pool(sb: Sandbox, snippets: dict[str, tuple[str, int]], clients: list[int]):
    for name, (code, jobs) in snippets.items():
        job = Job(code=code, stdin=TRIVIAL_STDIN, timeout_s=10.0)
        sb.run([job] * sb.workers)  # warm up
        for n in clients:
            yield _measure(
                f"rstar_sandbox ({sb.backend}, {sb.workers} workers)",
                name,
                n,
                jobs,
                lambda job=job: sb.run([job])[0].ok,
            )


def bench_fresh_interpreter(python: str, code: str, name: str, clients: int, jobs: int):
    def run_one() -> bool:
        proc = subprocess.run(
            [python, "-I", "-c", code],
            input=TRIVIAL_STDIN,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return proc.returncode == 0

    return _measure(f"subprocess, fresh `{python} -I` per job", name, clients, jobs, run_one)


def bench_docker_run(image: str, code: str, name: str, clients: int, jobs: int):
    def run_one() -> bool:
        proc = subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "-i",
                "--network",
                "none",
                image,
                "python3",
                "-I",
                "-c",
                code,
            ],
            input=TRIVIAL_STDIN,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return proc.returncode == 0

    return _measure("`docker run --rm` per job", name, clients, jobs, run_one)


def machine() -> str:
    python = sys.version.split()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {python}"
    )
