"""Sandbox throughput benchmark: jobs/s and p50/p99 latency at 1, 2, 8 and 64 clients,
for a trivial snippet, the same with numpy imported and a ~50 ms CPU-bound one, with the
CPU each job costs (and, for Docker, its page faults), two baselines in the same run
(`docker run --rm` per job, a fresh host interpreter per job), and the per-job cost of
the hardening steps measured in a worker-like container.

    python benchmarks/sandbox_throughput.py [--backend docker] [--workers N]
        [--clients 8 --repeat 5 --no-baselines]   # the spread of one figure
        [--preload '']                            # the cost of preloading numpy
        [--service --repeat 5]                    # the HTTP service against the pool

With `--service`: the in-process pool against one `rstar sandbox serve` with as many
workers (its own process, on loopback, no load balancer), the same trivial jobs from 16
threads in batches of 32, one after the other `--repeat` times; with the CPU a job costs
outside the workers, in this process (the pool, or the HTTP client) and in the service's.

Prints Markdown tables for docs/benchmarks.md, with the load average before and after
each row: the machine may be shared. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rstar_sandbox import Job, Sandbox
from rstar_sandbox.bench import (
    HEADER,
    NUMPY_TRIVIAL,
    TRIVIAL,
    bench_docker_run,
    bench_fresh_interpreter,
    bench_pool,
    cpu_bound_snippet,
    hardening_cost,
    load_average,
    machine,
)
from rstar_sandbox.image import default_image
from rstar_sandbox.workers import default_interpreter

SERVICE_THREADS, SERVICE_BATCH = 16, 32


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process (not its children: the workers)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _drive(sb, jobs: list[Job], pids: list[int]) -> tuple[float, list[float]]:
    """jobs/s from SERVICE_THREADS callers in batches, and the CPU ms a job cost in each of
    `pids`; every result checked against its job."""
    chunks = [jobs[i : i + SERVICE_BATCH] for i in range(0, len(jobs), SERVICE_BATCH)]
    before = [_cpu_s(pid) for pid in pids]
    start = time.perf_counter()
    with ThreadPoolExecutor(SERVICE_THREADS) as pool:
        results = [r for part in pool.map(sb.run, chunks) for r in part]
    took = time.perf_counter() - start
    expected = [str(sum(map(int, j.stdin.split()))) + "\n" for j in jobs]
    assert [r.stdout for r in results] == expected, "lost or misordered results"
    cpu = [(_cpu_s(pid) - b) / len(jobs) * 1e3 for pid, b in zip(pids, before, strict=True)]
    return len(jobs) / took, cpu


def service_rows(backend: str, workers: int | None, jobs: int, repeat: int) -> list[str]:
    from tests.fakes import servers

    work = [Job(code=TRIVIAL, stdin=f"{i} {i}\n") for i in range(jobs)]
    args = ["--backend", backend] + (["--workers", str(workers)] if workers else [])
    proc, url = servers.sandbox_service(*args)
    rows, ratios = [], []
    try:
        with (
            Sandbox(backend=backend, workers=workers) as pool,
            Sandbox(backend="http", urls=[url], batch_size=SERVICE_BATCH) as http,
        ):
            for sb in (pool, http):
                _drive(sb, work[:200], [])  # warm up
            for _ in range(repeat):
                loads = load_average()
                local, [local_cpu] = _drive(pool, work, [os.getpid()])
                served, [client_cpu, service_cpu] = _drive(http, work, [os.getpid(), proc.pid])
                ratios.append(served / local)
                rows.append(
                    f"| {local:.0f} | {local_cpu:.2f} | {served:.0f} | {client_cpu:.2f} | "
                    f"{service_cpu:.2f} | {served / local:.2f} | {loads} {load_average()} |"
                )
    finally:
        servers.stop(proc)
    header = (
        f"{backend} backend, {pool.workers} workers each, {jobs} trivial jobs per row\n\n"
        "| pool jobs/s | pool CPU ms/job | service jobs/s | client CPU ms/job "
        "| service CPU ms/job | service / pool | load |\n" + "| --- " * 7 + "|"
    )
    return [header, *rows, f"\nservice / pool, median: {statistics.median(ratios):.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "process"])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument(
        "--preload", default="numpy", help="comma-separated modules the workers preload"
    )
    parser.add_argument("--clients", default="1,2,8,64", help="comma-separated client counts")
    parser.add_argument("--repeat", type=int, default=1, help="measure every row this often")
    parser.add_argument("--trivial-jobs", type=int, default=2000)
    parser.add_argument("--numpy-jobs", type=int, default=500)
    parser.add_argument("--cpu-jobs", type=int, default=200)
    parser.add_argument("--baseline-jobs", type=int, default=40)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--service", action="store_true", help="the HTTP service against the pool")
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]
    if args.service:
        print(f"Machine: {machine()}\n")
        print("\n".join(service_rows(args.backend, args.workers, args.trivial_jobs, args.repeat)))
        return

    rows = []

    def record(row) -> None:
        line = f"{row.row()} {load_average()} |"
        print(line, flush=True)
        rows.append(line)

    print(f"load average at the start: {load_average()}", flush=True)
    preload = tuple(filter(None, args.preload.split(",")))
    with Sandbox(backend=args.backend, workers=args.workers, preload=preload) as sb:
        cpu = cpu_bound_snippet(sb)
        snippets = {
            "trivial": (TRIVIAL, args.trivial_jobs),
            "trivial, imports numpy": (NUMPY_TRIVIAL, args.numpy_jobs),
            "CPU ~50 ms": (cpu, args.cpu_jobs),
        }
        for _ in range(args.repeat):
            for row in bench_pool(sb, snippets, clients):
                record(row)
    if not args.no_baselines:
        python = default_interpreter()
        for name, code in (("trivial", TRIVIAL), ("CPU ~50 ms", cpu)):
            for n in (1, 8):
                record(bench_fresh_interpreter(python, code, name, n, args.baseline_jobs))
                if args.backend == "docker":
                    record(bench_docker_run(default_image(), code, name, n, args.baseline_jobs))
    print(f"\nMachine: {machine()}\n")
    title, rule = HEADER.splitlines()
    print(f"{title} load |\n{rule} --- |")
    for line in rows:
        print(line)
    if args.backend == "docker":
        print(f"\nHardening, per job (load {load_average()}):\n")
        print(hardening_cost(default_image()))


if __name__ == "__main__":
    main()
