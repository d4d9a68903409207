"""Scale-out overhead on one machine: the `hosts` profile against `local`, and the sandbox
service through haproxy against the in-process pool.

1. The verification chain of a scripted-model batch (the fake model of
   tests/fakes/coder.py, so only orchestration and sandbox work are
   measured), thousands of sandbox executions: `dagster asset materialize` with
   RSTAR_DEPLOYMENT=local (SQLite instance, multiprocess executor) against
   RSTAR_DEPLOYMENT=hosts (Postgres, Redis, two `rstar worker`s), cold caches each time.
2. Sandbox jobs from 16 threads, in batches: Sandbox(backend="process", workers=W) in
   this process against two `rstar sandbox serve` (W/2 workers each) behind haproxy.

    python benchmarks/scale_out.py [--repeats 3] [--seeds 6]

Needs postgresql, redis-server and haproxy (Debian), as the tests do. Prints Markdown for
docs/benchmarks.md. Other work may share the machine: the load average is printed with
every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import dagster as dg  # noqa: E402

from rstar_pipelines.deployment.instance import init_instance  # noqa: E402
from rstar_pipelines.storage import read_table  # noqa: E402
from rstar_sandbox import Job, Sandbox  # noqa: E402
from rstar_sandbox.bench import machine  # noqa: E402
from tests.fakes import servers  # noqa: E402
from tests.fakes.coder import CHAIN, SEEDS, scripted_spec  # noqa: E402
from tests.fakes.coder_location import materialize  # noqa: E402

ECHO = "print(input())\n"


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def seeds(n_code: int) -> list[dict]:
    """n_code variants of the scripted code seed (each a problem of its own) and the math one."""
    code, math = SEEDS
    variants = [{**code, "problem": f"{code['problem']} (set {i})"} for i in range(n_code)]
    return [*variants, math]


def chain_run(profile: str, n_code: int, postgres: str | None, broker: str | None) -> dict:
    """One cold materialization of the chain; wall time and sandbox executions."""
    root = Path(tempfile.mkdtemp(prefix=f"rstar-bench-{profile}-"))
    env = {
        **os.environ,
        "DAGSTER_HOME": str(root / "home"),
        "RSTAR_DATA_DIR": str(root / "data"),
        "RSTAR_DEPLOYMENT": profile,
    }
    incoming = root / "data" / "seeds" / "incoming"
    incoming.mkdir(parents=True)
    (incoming / "b.jsonl").write_text("\n".join(json.dumps(s) for s in seeds(n_code)) + "\n")
    workers = []
    if profile == "hosts":
        env.update(RSTAR_POSTGRES_URL=servers.new_database(postgres), RSTAR_CELERY_BROKER=broker)
        os.environ["RSTAR_POSTGRES_URL"] = env["RSTAR_POSTGRES_URL"]
        init_instance(root / "home", "hosts", scripted_spec().pools(), {})
        for name, queues in (("gpuhost", "llm,gpu,sandbox"), ("cpuhost", "sandbox,dagster")):
            workers.append(servers.celery_worker(env, name, queues))
    else:
        (root / "home").mkdir()
        (root / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    try:
        with dg.DagsterInstance.from_config(str(root / "home")) as instance:
            instance.add_dynamic_partitions("seed_batches", ["b"])
        start = time.perf_counter()
        proc = materialize(env, CHAIN, "b")
        log = proc.communicate()[0]
        if proc.returncode:
            raise RuntimeError(f"the {profile} run failed:\n{log[-3000:]}")
        wall = time.perf_counter() - start
    finally:
        for proc in workers:
            servers.stop(proc)
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        [record] = instance.get_run_records()
        dispatch = step_dispatch_s(instance, record.dagster_run.run_id)
    outputs = read_table(root / "data" / "lake" / "verified_outputs" / "b.parquet").to_pylist()
    executions = sum(len(r["inputs"]) * len(r["candidates"]) for r in outputs if r["inputs"])
    inputs = read_table(root / "data" / "lake" / "test_inputs" / "b.parquet").to_pylist()
    return {
        "wall_s": wall,
        "executions": executions,
        "test_input_rows": len(inputs),
        "dispatch_s": dispatch,
    }


def step_dispatch_s(instance: dg.DagsterInstance, run_id: str) -> float:
    """Mean time from a step's first event (its process being launched, or its Celery
    task being sent) to its start: what the executor costs per step."""
    first, started = {}, {}
    for entry in instance.all_logs(run_id):
        if entry.step_key is None or entry.dagster_event is None:
            continue
        first.setdefault(entry.step_key, entry.timestamp)
        if entry.dagster_event.event_type == dg.DagsterEventType.STEP_START:
            started[entry.step_key] = entry.timestamp
    return statistics.mean(started[k] - first[k] for k in started)


def drive(sb, jobs: list[Job], threads: int, batch: int) -> float:
    """jobs/s with `threads` callers each sending `batch` jobs per call."""
    chunks = [jobs[i : i + batch] for i in range(0, len(jobs), batch)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = [r for part in pool.map(sb.run, chunks) for r in part]
    took = time.perf_counter() - start
    assert [r.stdout for r in results] == [j.stdin for j in jobs], "lost or misordered results"
    return len(jobs) / took


def sandbox_throughput(workers: int, jobs: int, batch: int) -> tuple[float, float]:
    work = [Job(code=ECHO, stdin=f"{i}\n") for i in range(jobs)]
    with Sandbox(backend="process", workers=workers) as sb:
        drive(sb, work[:200], 16, batch)  # warm up
        local = drive(sb, work, 16, batch)
    half = str(max(1, workers // 2))
    a, url_a = servers.sandbox_service("--workers", half)
    b, url_b = servers.sandbox_service("--workers", half)
    try:
        with (
            servers.haproxy([url_a[7:], url_b[7:]]) as lb,
            Sandbox(backend="http", urls=[lb], batch_size=batch, workers=16) as sb,
        ):
            drive(sb, work[:200], 16, batch)
            served = drive(sb, work, 16, batch)
    finally:
        servers.stop(a)
        servers.stop(b)
    return local, served


def spread(values: list[float], digits: int = 1) -> str:
    med, low, high = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=6, help="code seeds in the batch")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--skip-chain", action="store_true")
    args = parser.parse_args()

    print(f"Machine: {machine()}\n")
    if not args.skip_chain:
        with servers.postgres() as pg, servers.redis() as broker:
            walls: dict[str, list[float]] = {"local": [], "hosts": []}
            dispatch: dict[str, list[float]] = {"local": [], "hosts": []}
            for repeat in range(args.repeats):
                for profile in ("local", "hosts"):
                    run = chain_run(profile, args.seeds, pg, broker)
                    walls[profile].append(run["wall_s"])
                    dispatch[profile].append(run["dispatch_s"])
                    print(
                        f"repeat {repeat + 1} {profile}: {run['wall_s']:.1f} s, "
                        f"{run['dispatch_s']:.1f} s from launch to start per step, "
                        f"{run['executions']} verification executions, load {load()}",
                        flush=True,
                    )
        local, hosts = statistics.median(walls["local"]), statistics.median(walls["hosts"])
        steps = len(set(CHAIN) - {"seed_rejects"})
        print("\n| profile | wall s | launch to start per step, s |\n| --- | --- | --- |")
        for profile, label in (("local", "local"), ("hosts", "hosts (2 Celery workers)")):
            print(f"| {label} | {spread(walls[profile])} | {spread(dispatch[profile])} |")
        print("(median (min-max) over the repeats)")
        print(
            f"\nhosts overhead: {hosts - local:+.1f} s ({(hosts - local) / local:+.1%} of local), "
            f"{(hosts - local) / steps:+.2f} s per step, "
            f"{(hosts - local) / run['executions'] * 1e3:+.2f} ms per verification execution"
        )
    rates = [sandbox_throughput(args.workers, args.jobs, args.batch) for _ in range(args.repeats)]
    print(f"\nSandbox, {args.workers} workers in all, 16 threads, batches of {args.batch}:")
    print("| path | jobs/s, median (min-max) |\n| --- | --- |")
    print(f"| in-process pool | {spread([r[0] for r in rates])} |")
    print(f"| 2 services behind haproxy | {spread([r[1] for r in rates])} |")
    ratios = [served / local for local, served in rates]
    print(f"\nservice / in-process: {spread(ratios, 2)}x; load {load()}")


if __name__ == "__main__":
    main()
