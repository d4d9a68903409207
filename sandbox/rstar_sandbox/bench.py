"""Throughput and latency of the sandbox, against two baselines.

Each client is a thread that submits one job at a time and waits for its result, as
an MCTS expansion or a verification step does; jobs/s is over all clients together.
Baselines: a `docker run --rm` per job, and a fresh host interpreter per job. For the
pool, the CPU a job costs is measured too (it does not depend on what else runs on the
machine, unlike jobs/s): in this process (the pool and its clients) and, for the Docker
backend, in the worker containers, with their page faults.
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
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
NUMPY_TRIVIAL = "import numpy as np\n" + TRIVIAL.replace("a + b", "np.add(a, b)")
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
    cost: JobCost | None = None

    def row(self) -> str:
        cost = self.cost.cells() if self.cost else "| | | |"
        return (
            f"| {self.system} | {self.snippet} | {self.clients} | {self.jobs} | "
            f"{self.jobs_per_s:.0f} | {self.p50_ms:.1f} | {self.p99_ms:.1f} | {self.failures} "
            f"{cost}"
        )


HEADER = (
    "| system | snippet | clients | jobs | jobs/s | p50 ms | p99 ms | failed "
    "| host CPU µs/job | worker CPU µs/job | page faults/job |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


@dataclass
class JobCost:
    """CPU per job in this process (pool and clients) and, for Docker, in the workers."""

    host_cpu_us: float
    worker_cpu_us: float | None
    page_faults: float | None

    def cells(self) -> str:
        def cell(value: float | None) -> str:
            return "" if value is None else f"{value:.0f}"

        return (
            f"| {cell(self.host_cpu_us)} | {cell(self.worker_cpu_us)} | {cell(self.page_faults)} |"
        )


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _container_counters(containers) -> tuple[int, int]:
    """The containers' CPU nanoseconds and page faults so far."""
    cpu_ns = faults = 0
    for container in containers:
        stats = container.stats(stream=False, one_shot=True)
        cpu_ns += stats["cpu_stats"]["cpu_usage"]["total_usage"]
        memory = stats["memory_stats"].get("stats", {})
        faults += memory.get("total_pgfault", memory.get("pgfault", 0))  # cgroup v1, v2
    return cpu_ns, faults


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
    containers = [w.container for w in sb.live_workers() if hasattr(w, "container")]
    for name, (code, jobs) in snippets.items():
        job = Job(code=code, stdin=TRIVIAL_STDIN, timeout_s=10.0)
        sb.run([job] * sb.workers)  # warm up
        for n in clients:
            workers_before = _container_counters(containers) if containers else None
            host_before = _process_cpu_s()
            row = _measure(
                f"rstar_sandbox ({sb.backend}, {sb.workers} workers)",
                name,
                n,
                jobs,
                lambda job=job: sb.run([job])[0].ok,
            )
            row.cost = JobCost((_process_cpu_s() - host_before) * 1e6 / row.jobs, None, None)
            if workers_before is not None:
                cpu_ns, faults = _container_counters(containers)
                row.cost.worker_cpu_us = (cpu_ns - workers_before[0]) / 1e3 / row.jobs
                row.cost.page_faults = (faults - workers_before[1]) / row.jobs
            yield row


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


def load_average() -> str:
    """The 1-minute load average: other work on the machine distorts every figure."""
    return f"{os.getloadavg()[0]:.1f}"


# Runs inside a container locked down as the workers are: times, per job, the steps the
# hardening adds, with the server's own functions (10th percentiles of single timings).
HARDENING_STEPS = """
import os, sys, time
sys.path.insert(0, "/opt/rstar")
import server
N = int(sys.argv[1])
server._prctl(server.PR_SET_DUMPABLE, 0)  # as the server starts
server._prctl(server.PR_SET_NO_NEW_PRIVS, 1)
os.setgroups([])
job_uid = 10001
def p10(samples):  # other work on the machine only ever adds time
    return sorted(samples)[len(samples) // 10] * 1e6
def in_children(zygote, step):
    took = []
    for _ in range(N):
        r, w = os.pipe()
        pid = zygote.fork()
        if pid == 0:
            start = time.perf_counter()
            step(zygote)
            os.write(w, repr(time.perf_counter() - start).encode())
            os._exit(0)
        os.close(w)
        took.append(float(os.read(r, 64)))
        os.close(r)
        os.waitpid(pid, 0)
    return p10(took)
def fork_and_reap(zygote):
    took = []
    for _ in range(N):
        start = time.perf_counter()
        pid = zygote.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        took.append(time.perf_counter() - start)
    return p10(took)
supervisor = server.Supervisor(None, job_uid, None)
reset = []
for _ in range(N):
    start = time.perf_counter()
    supervisor._reset()
    reset.append(time.perf_counter() - start)
plain = server.Zygote(job_uid, syscall_filter=False)
filtered = server.Zygote(job_uid, syscall_filter=True)
drop = in_children(plain, server.Zygote._drop_privileges)
print(f"reset after a job (kill(-1) as the job user, a look at /proc, empty /tmp and /dev/shm): "
      f"{p10(reset):.1f} us")
print(f"job child drops privileges (OOM score, gid, uid, dumpable): {drop:.1f} us; "
      f"with the syscall filter (process backend): "
      f"{in_children(filtered, server.Zygote._drop_privileges):.1f} us")
print(f"for scale, fork and reap a job child from the zygote: {fork_and_reap(plain):.1f} us")
"""


def hardening_cost(image: str, jobs: int = 2000) -> str:
    """The per-job cost of the hardening steps, measured in a worker-like container."""
    from rstar_sandbox.pool import docker_client
    from rstar_sandbox.workers import CONTAINER_SERVER, SERVER_FILE, locked_down

    output = docker_client().containers.run(
        image,
        command=["python3", "-I", "-c", HARDENING_STEPS, str(jobs)],
        remove=True,
        **locked_down(tmpfs_mb=64),
        environment={"OPENBLAS_NUM_THREADS": "1"},
        volumes={str(SERVER_FILE): {"bind": CONTAINER_SERVER, "mode": "ro"}},
    )
    return output.decode()
