"""Sandbox throughput benchmark: jobs/s and p50/p99 latency at 1, 2, 8 and 64 clients,
for a trivial snippet and a ~50 ms CPU-bound one, with two baselines in the same run
(`docker run --rm` per job, a fresh host interpreter per job).

    python benchmarks/sandbox_throughput.py [--backend docker] [--workers N]

Prints a Markdown table for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse

from rstar_sandbox import Sandbox
from rstar_sandbox.bench import (
    HEADER,
    TRIVIAL,
    bench_docker_run,
    bench_fresh_interpreter,
    bench_pool,
    cpu_bound_snippet,
    machine,
)
from rstar_sandbox.image import default_image
from rstar_sandbox.workers import default_interpreter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "process"])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--trivial-jobs", type=int, default=2000)
    parser.add_argument("--cpu-jobs", type=int, default=200)
    parser.add_argument("--baseline-jobs", type=int, default=40)
    args = parser.parse_args()

    rows = []
    with Sandbox(backend=args.backend, workers=args.workers) as sb:
        cpu = cpu_bound_snippet(sb)
        snippets = {"trivial": (TRIVIAL, args.trivial_jobs), "CPU ~50 ms": (cpu, args.cpu_jobs)}
        for row in bench_pool(sb, snippets, [1, 2, 8, 64]):
            print(row.row(), flush=True)
            rows.append(row)
    python = default_interpreter()
    for name, code in (("trivial", TRIVIAL), ("CPU ~50 ms", cpu)):
        for clients in (1, 8):
            for row in (
                bench_fresh_interpreter(python, code, name, clients, args.baseline_jobs),
                bench_docker_run(default_image(), code, name, clients, args.baseline_jobs)
                if args.backend == "docker"
                else None,
            ):
                if row:
                    print(row.row(), flush=True)
                    rows.append(row)
    print(f"\nMachine: {machine()}\n")
    print(HEADER)
    for row in rows:
        print(row.row())


if __name__ == "__main__":
    main()
