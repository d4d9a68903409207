"""Mutual verification throughput: executions/s through `mutual_verify_many` against the
sandbox's raw throughput for the same jobs (submitted directly with `sandbox.run`) in the
same run. Defaults: 20 problems x 16 candidates x 50 inputs = 16,000 executions each way,
best of 2 rounds.

    python benchmarks/mutual_verification.py [--backend docker] [--workers N]

Every problem is "sum a list of a few hundred integers": 12 correct candidates written
differently (some pad their output, so normalization matters) and 4 wrong ones, so each
problem verifies at 75% agreement. Prints a Markdown table for docs/benchmarks.md. Not a
test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import random
import time

from rstar_pipelines.coder.verification import VerificationTask, mutual_verify_many
from rstar_sandbox import Job, Sandbox
from rstar_sandbox.bench import machine

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="docker", choices=["docker", "process"])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--inputs", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="each way; the best counts")
    args = parser.parse_args()

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
