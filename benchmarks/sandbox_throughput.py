"""Sandbox throughput benchmark: jobs/s and p50/p99 latency at 1, 2, 8 and 64 clients,
for a trivial snippet, the same with numpy imported and a ~50 ms CPU-bound one, with the
CPU each job costs (and, for Docker, its page faults), two baselines in the same run
(`docker run --rm` per job, a fresh host interpreter per job), and the per-job cost of
the hardening steps measured in a worker-like container.

    python benchmarks/sandbox_throughput.py [--backend docker] [--workers N]
        [--clients 8 --repeat 5 --no-baselines]   # the spread of one figure
        [--preload '']                            # the cost of preloading numpy

Prints Markdown tables for docs/benchmarks.md, with the load average before and after
each row: the machine may be shared. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse

from rstar_sandbox import Sandbox
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
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]

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
