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


def load_average() -> str:
    """The 1-minute load average: other work on the machine distorts every figure."""
    return f"{os.getloadavg()[0]:.1f}"


# Runs inside a container started as the pool starts its workers: times, per job, the
# steps the hardening adds, with the server's own functions.
HARDENING_STEPS = """
import os, sys, time
sys.path.insert(0, "/opt/rstar")
import server
N = int(sys.argv[1])
def per_job(step):  # the 10th percentile: other work on the machine only adds time
    took = []
    for _ in range(N):
        start = time.perf_counter()
        step()
        took.append(time.perf_counter() - start)
    return sorted(took)[N // 10] * 1e6
server._prctl(server.PR_SET_DUMPABLE, 0)  # as the server starts
server._prctl(server.PR_SET_NO_NEW_PRIVS, 1)
os.setgroups([])
job_uid = 10001
supervisor = server.Supervisor(None, job_uid, None)
zygote = server.Zygote(job_uid, syscall_filter=True)
def child(work):
    def fork_one():
        pid = zygote.fork()
        if pid == 0:
            work()
            os._exit(0)
        os.waitpid(pid, 0)
    return fork_one
bare = per_job(child(lambda: None))
drop = per_job(child(zygote._drop_privileges)) - bare
seccomp_off = server.Zygote(job_uid, syscall_filter=False)
drop_no_filter = per_job(child(seccomp_off._drop_privileges)) - bare
print(f"reset after a job (kill(-1) as the job user, empty /tmp and /dev/shm): "
      f"{per_job(supervisor._reset):.1f} us")
print(f"job child drops privileges (OOM score, gid, uid, dumpable): "
      f"{drop_no_filter:.1f} us; with the syscall filter (process backend): {drop:.1f} us")
print(f"for scale, fork and reap a job child from the zygote: {bare:.1f} us")
"""


def hardening_cost(image: str, jobs: int = 2000) -> str:
    """The per-job cost of the hardening steps, measured in a worker-like container."""
    from rstar_sandbox.pool import docker_client
    from rstar_sandbox.server import IPC_SYSCTLS, TMPFS_INODES, WRITABLE
    from rstar_sandbox.workers import CONTAINER_SERVER, SERVER_FILE

    tmpfs = f"rw,nosuid,nodev,noexec,size=64m,nr_inodes={TMPFS_INODES},mode=1777"
    output = docker_client().containers.run(
        image,
        command=["python3", "-I", "-c", HARDENING_STEPS, str(jobs)],
        remove=True,
        network_mode="none",
        read_only=True,
        tmpfs=dict.fromkeys(WRITABLE, tmpfs),
        sysctls=IPC_SYSCTLS,
        user="0:0",
        cap_drop=["ALL"],
        cap_add=["SETUID", "SETGID"],
        security_opt=["no-new-privileges"],
        environment={"OPENBLAS_NUM_THREADS": "1"},
        volumes={str(SERVER_FILE): {"bind": CONTAINER_SERVER, "mode": "ro"}},
    )
    return output.decode()
