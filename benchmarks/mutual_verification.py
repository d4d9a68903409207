"""Mutual verification throughput: executions/s through `mutual_verify_many` against the
sandbox's raw throughput for the same jobs (submitted directly with `sandbox.run`) in the
same run. Defaults: 20 problems x 16 candidates x 50 inputs = 16,000 executions each way,
best of 2 rounds.

    python benchmarks/mutual_verification.py [--backend docker] [--workers N]
    python benchmarks/mutual_verification.py --seeds 100,500   # the chain's stage at scale

With `--seeds`: the `verified_outputs` stage (its item cache, decisions and determinism
check included) on the scripted model's candidates (tests/fakes/coder.py) for that many
code seeds, each with its synthesized problem, against the same executions through
`sandbox.run`; each seed count in a process of its own, whose peak RSS after the stage
(before the raw jobs exist) is the stage's memory.

Every problem is "sum a list of a few hundred integers": 12 correct candidates written
differently (some pad their output, so normalization matters) and 4 wrong ones, so each
problem verifies at 75% agreement. Prints a Markdown table for docs/benchmarks.md. Not a
test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa

from rstar_pipelines.coder.extract import extract_program
from rstar_pipelines.coder.verification import VerificationTask, mutual_verify_many
from rstar_pipelines.coder.verification_stages import MutualVerification
from rstar_pipelines.pipeline.stage import StageContext
from rstar_pipelines.storage import schemas
from rstar_sandbox import Job, Sandbox
from rstar_sandbox.bench import load_average, machine
from tests.fakes.coder import SUM, scripted_reply

TIMEOUT_S = 5.0
MEMORY_MB = 256

CORRECT = [
    "n = int(input())\nprint(sum(map(int, input().split())))\n",
    "import sys\ndata = sys.stdin.read().split()\nprint(sum(int(x) for x in data[1:]))\n",
    "n = int(input())\ntotal = 0\nfor x in input().split():\n    total += int(x)\nprint(total)\n",
    "print(sum(map(int, open(0).read().split()[1:])))\n",
    "input()\nprint(str(sum(int(x) for x in input().split())) + '  ')\n",
    "input()\nprint(sum(map(int, input().split())))\nprint()\n",
    "import functools\nimport operator\ninput()\n"
    "print(functools.reduce(operator.add, map(int, input().split()), 0))\n",
    "import numpy as np\ninput()\nprint(int(np.array(input().split(), dtype=np.int64).sum()))\n",
    "import sys\nn = int(sys.stdin.readline())\nxs = list(map(int, sys.stdin.readline().split()))\n"
    "sys.stdout.write(f'{sum(xs[:n])}\\n')\n",
    "def solve(xs):\n    return sum(xs)\n\n\n"
    "input()\nprint(solve([int(x) for x in input().split()]))\n",
    "import math\ninput()\nprint(math.fsum(map(int, input().split())).__trunc__())\n",
    "n = int(input())\nxs = input().split()\ns = 0\ni = 0\nwhile i < n:\n"
    "    s += int(xs[i])\n    i += 1\nprint(s, end='\\t\\n')\n",
]
WRONG = [
    "print(sum(map(int, open(0).read().split())))\n",  # adds n as well
    "input()\nprint(sum(abs(int(x)) for x in input().split()))\n",
    "input()\nxs = list(map(int, input().split()))\nprint(sum(xs[1:]))\n",
    "input()\nprint(max(map(int, input().split())))\n",
]


def problems(count: int, candidates: int, inputs: int, seed: int = 0) -> list[VerificationTask]:
    rng = random.Random(seed)
    right = max(1, candidates * 3 // 4)
    tasks = []
    for p in range(count):
        programs = [CORRECT[(p + i) % len(CORRECT)] for i in range(right)]
        programs += [WRONG[(p + i) % len(WRONG)] for i in range(candidates - right)]
        rng.shuffle(programs)
        stdins = []
        for _ in range(inputs):
            xs = [rng.randint(-1000, 1000) for _ in range(rng.randint(100, 400))]
            stdins.append(f"{len(xs)}\n{' '.join(map(str, xs))}\n")
        tasks.append(VerificationTask(programs, stdins))
    return tasks


def raw_jobs(tasks: list[VerificationTask]) -> list[Job]:
    return [
        Job(code=code, stdin=stdin, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
        for task in tasks
        for code in task.candidates
        for stdin in task.inputs
    ]


SEED_INPUTS = 12  # test inputs per problem
SCRIPTED = (("print their sum", True), ("sum of their squares", False))


def chain_tables(seeds: int, seed: int = 0) -> dict[str, pa.Table]:
    """The stage's inputs for `seeds` code seeds: each seed (its oracle labels it) and the
    problem synthesized from it, with SEED_INPUTS inputs and the scripted model's ten
    candidates each."""
    rng = random.Random(seed)
    problems, tests, candidates = [], [], []
    for i in range(seeds):
        for prompt, is_seed in SCRIPTED:
            pid = f"{'s' if is_seed else 'p'}{i}"
            problems.append(
                {
                    "id": pid,
                    "batch": "b",
                    "domain": "code",
                    "problem": prompt,
                    "oracle_solutions": [SUM] if is_seed else [],
                    "is_seed": is_seed,
                    "seed_id": f"s{i}",
                }
            )
            stdins = []
            for _ in range(SEED_INPUTS):
                xs = [rng.randint(-50, 50) for _ in range(rng.randint(1, 100))]
                stdins.append(f"{len(xs)}\n{' '.join(map(str, xs))}\n")
            tests.append({"problem_id": pid, "batch": "b", "domain": "code", "inputs": stdins})
            for k in range(10):
                text = scripted_reply(prompt, k)
                program, error = extract_program(text)
                candidates.append(
                    {
                        "id": f"{pid}-{k}",
                        "problem_id": pid,
                        "batch": "b",
                        "domain": "code",
                        "candidate_index": k,
                        "text": text,
                        "program": program,
                        "parse_error": error,
                    }
                )
    return {
        "synthesized_problems": pa.Table.from_pylist(problems, schema=schemas.SYNTHESIZED_PROBLEMS),
        "test_inputs": pa.Table.from_pylist(tests, schema=schemas.TEST_INPUTS),
        "candidate_solutions": pa.Table.from_pylist(candidates, schema=schemas.CANDIDATE_SOLUTIONS),
    }


class _Counting:
    """The sandbox as the stage's resource (`get()`), counting the jobs it runs."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox, self.jobs = sandbox, 0

    def get(self) -> _Counting:
        return self

    def run(self, jobs):
        self.jobs += len(jobs)
        return self.sandbox.run(jobs)

    def stream(self, jobs):
        self.jobs += len(jobs)
        return self.sandbox.stream(jobs)


def stage_pass(stage: MutualVerification, tables, sandbox: _Counting) -> tuple[float, list[dict]]:
    """One cold run of the stage (a fresh item cache): seconds and its rows."""
    with tempfile.TemporaryDirectory(prefix="rstar-mv-") as tmp:
        ctx = StageContext(
            partition_key="b",
            log=logging.getLogger("mutual_verification"),
            resources={"sandbox": sandbox},
            cache_path=Path(tmp) / "cache.sqlite",
            cache_namespace=stage.cache_namespace(),
        )
        started = time.perf_counter()
        result = stage.run(ctx, tables)
        took = time.perf_counter() - started
        ctx.cache.close()
    return took, result.table.to_pylist()


def stage_raw_jobs(tables, rows: list[dict], stage: MutualVerification) -> list[Job]:
    """The executions the stage made, for `sandbox.run`: every program on every input,
    then the determinism check's re-runs of each verified problem's labelling program."""
    p = stage.params
    programs: dict[str, list[str]] = {}
    for c in tables["candidate_solutions"].to_pylist():
        programs.setdefault(c["problem_id"], []).append(c["program"])
    oracles = {r["id"]: r["oracle_solutions"] for r in tables["synthesized_problems"].to_pylist()}
    jobs, checks = [], []
    for row in rows:
        mine = programs[row["problem_id"]] + oracles[row["problem_id"]][:1]
        jobs += [
            Job(code=code, stdin=stdin, timeout_s=p.timeout_s, memory_mb=p.memory_mb)
            for code in mine
            for stdin in row["inputs"]
        ]
        if row["verified"]:
            agreeing = [v["candidate_index"] for v in row["candidates"] if v["agrees"]]
            label_by = mine[-1] if row["label_source"] == "oracle" else mine[agreeing[0]]
            step = max(1, len(row["inputs"]) // p.determinism_sample)
            sample = row["inputs"][::step][: p.determinism_sample]
            checks += [
                Job(code=label_by, stdin=s, timeout_s=p.timeout_s, memory_mb=p.memory_mb)
                for s in sample
            ]
    return jobs + checks


def one_seed_count(backend: str, workers: int | None, seeds: int, rounds: int) -> dict:
    """The stage against raw `sandbox.run` at one seed count, alternating, best of `rounds`
    each; the peak RSS right after the first stage run."""
    tables = chain_tables(seeds)
    stage = MutualVerification(MutualVerification.Params())
    loads = [load_average()]
    with Sandbox(backend=backend, workers=workers) as sb:
        counting = _Counting(sb)
        sb.run(raw_jobs(problems(2, 4, 10)))  # warm up
        chain_s, rows = stage_pass(stage, tables, counting)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        jobs = stage_raw_jobs(tables, rows, stage)
        assert len(jobs) == counting.jobs, f"{len(jobs)} raw jobs, the stage ran {counting.jobs}"
        raw_s = float("inf")
        for turn in range(rounds):
            for name in ("raw", "chain") if turn % 2 == 0 else ("chain", "raw"):
                if name == "raw":
                    started = time.perf_counter()
                    results = sb.run(jobs)
                    raw_s = min(raw_s, time.perf_counter() - started)
                    assert all(r.ok for r in results), "a raw execution failed"
                elif turn:
                    chain_s = min(chain_s, stage_pass(stage, tables, counting)[0])
            loads.append(load_average())
        system = f"{sb.backend}, {sb.workers} workers"
    verified = sum(r["verified"] for r in rows)
    return {
        "seeds": seeds,
        "problems": len(rows),
        "verified": verified,
        "executions": len(jobs),
        "chain_s": chain_s,
        "raw_s": raw_s,
        "peak_rss_mb": peak_mb,
        "system": system,
        "loads": loads,
    }


def seeds_table(args) -> None:
    """Each seed count in a process of its own (its own peak RSS); one table."""
    rows = []
    for n in [int(x) for x in args.seeds.split(",")]:
        command = [sys.executable, __file__, "--one-seed-count", str(n), "--backend", args.backend]
        command += ["--rounds", str(args.rounds)]
        command += ["--workers", str(args.workers)] if args.workers else []
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.splitlines()[-1]))
        print(rows[-1], flush=True)
    print(f"\nMachine: {machine()}\n")
    print(
        "| seeds | problems (verified) | executions | raw s | raw exec/s | stage s "
        "| stage exec/s | stage / raw | stage s per seed | peak RSS MiB | load |"
    )
    print("| --- " * 11 + "|")
    for r in rows:
        print(
            f"| {r['seeds']} | {r['problems']} ({r['verified']}) | {r['executions']} "
            f"| {r['raw_s']:.1f} | {r['executions'] / r['raw_s']:.0f} | {r['chain_s']:.1f} "
            f"| {r['executions'] / r['chain_s']:.0f} | {r['raw_s'] / r['chain_s']:.2f} "
            f"| {r['chain_s'] / r['seeds'] * 1e3:.0f} ms | {r['peak_rss_mb']:.0f} "
            f"| {' '.join(r['loads'])} |"
        )
    print(f"\n{rows[0]['system']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "process"])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--inputs", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="each way; the best counts")
    parser.add_argument("--seeds", help="comma-separated seed counts: the stage at scale")
    parser.add_argument("--one-seed-count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_seed_count:
        result = one_seed_count(args.backend, args.workers, args.one_seed_count, args.rounds)
        print(json.dumps(result))
        return
    if args.seeds:
        seeds_table(args)
        return

    tasks = problems(args.problems, args.candidates, args.inputs)
    jobs = raw_jobs(tasks)
    best = {"raw": float("inf"), "mutual": float("inf")}
    with Sandbox(backend=args.backend, workers=args.workers) as sb:
        sb.run(jobs[: sb.workers * 20])  # warm up
        # alternate the order, and keep each one's best round, so neither gains from going
        # second on a warmer machine
        for turn in range(args.rounds):
            for name in ("raw", "mutual") if turn % 2 == 0 else ("mutual", "raw"):
                started = time.perf_counter()
                if name == "raw":
                    raw = sb.run(jobs)
                else:
                    verified = mutual_verify_many(tasks, sb, 0.6, TIMEOUT_S, MEMORY_MB)
                best[name] = min(best[name], time.perf_counter() - started)
        system = f"({sb.backend}, {sb.workers} workers)"

    failed = sum(not r.ok for r in raw)
    agreements = sorted({round(mv.agreement, 3) for mv in verified})
    print(f"raw: {failed} of {len(raw)} runs failed")
    print(
        f"mutual verification: {sum(mv.verified for mv in verified)} of {len(tasks)} problems"
        f" verified, agreement {agreements}\n\nMachine: {machine()}\n"
    )
    print("| system | executions | seconds | executions/s | ratio to raw |")
    print("| --- | --- | --- | --- | --- |")
    names = {"raw": f"raw `sandbox.run` {system}", "mutual": "`mutual_verify_many`"}
    for key, seconds in best.items():
        rate = len(jobs) / seconds
        ratio = best["raw"] / seconds
        print(f"| {names[key]} | {len(jobs)} | {seconds:.1f} | {rate:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
