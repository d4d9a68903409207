"""How busy the LLM layer keeps a fleet of continuously batching servers: throughput as a
fraction of the fleet's ceiling, through the client, through `candidate_solutions` in Dagster,
and MCTS trees/hour against the reference's lock-step schedule.

    python benchmarks/llm_serving.py [--batch 128] [--tick-ms 10] [--max-tokens 128] [--quick]

The fleet is simulated on loopback, in a process of its own (so the client's work does not slow
its clock): each replica is an HTTP server speaking vLLM's OpenAI API (`/v1/models` says
`owned_by: "vllm"`, `n` and `return_token_ids` are honoured) that decodes up to `--batch`
sequences at once, each gaining one token per tick and freeing its slot when it ends; the rest
wait in a first-come queue. A sequence's length is drawn from its prompt and seed, long-tailed
as long-CoT sampling is: 85% stop between 5% and 40% of max_tokens, 15% run to max_tokens. The
simulation is exact in ticks (a slot freed at tick t takes the next queued sequence at tick t,
however late the server's loop runs); a request is answered when its last sequence ends.

Busy fraction = tokens decoded / (replicas x batch x ticks), from the first request's arrival
to the last sequence's end: the drain at the end of a finite workload counts against it (the
table also gives it up to the last sequence's start, where the drain begins). Every
run uses the client's defaults (no in-flight window or `n` setting given). Prints Markdown for
docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# -- the simulated fleet ---------------------------------------------------------------------


class Replica:
    """One continuously batching server, simulated in ticks."""

    def __init__(self, batch: int, tick_s: float):
        self.batch, self.tick_s = batch, tick_s
        self.origin = time.monotonic()
        self.reset()

    def reset(self) -> None:
        self.queue: list[tuple[int, int, int, asyncio.Future]] = []  # FIFO, popped from front
        self.running: list[tuple[int, int, asyncio.Future]] = []  # heap of (end, id, future)
        self.free_at: list[int] = [0] * self.batch  # heap: tick at which each slot frees
        self.spans: list[tuple[int, int]] = []  # (start, end) tick of every sequence
        self.arrivals: list[int] = []
        self._ids = 0

    def now(self) -> int:
        return int((time.monotonic() - self.origin) / self.tick_s)

    def add(self, length: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        tick = self.now()
        self.arrivals.append(tick)
        self._ids += 1
        self.queue.append((tick, self._ids, length, future))
        self.advance(tick)
        return future

    def advance(self, tick: int) -> None:
        """Run the simulation up to `tick`: queued sequences take slots as slots free."""
        while self.queue and self.free_at[0] <= tick:
            free = heapq.heappop(self.free_at)
            arrival, seq_id, length, future = self.queue.pop(0)
            start = max(free, arrival)
            end = start + length
            heapq.heappush(self.free_at, end)
            heapq.heappush(self.running, (end, seq_id, future))
            self.spans.append((start, end))
        while self.running and self.running[0][0] <= tick:
            _, _, future = heapq.heappop(self.running)
            if not future.done():
                future.set_result(None)

    def stats(self) -> dict:
        return {"spans": self.spans, "arrivals": self.arrivals, "batch": self.batch}


def sequence_length(key: str, max_tokens: int) -> int:
    rng = random.Random(key)
    if rng.random() < 0.15:
        return max_tokens
    return max(1, round(max_tokens * rng.uniform(0.05, 0.4)))


def scripted_text(prompt: str, index: int) -> tuple[str, str | None]:
    """MCTS prompts get the scripted steps of benchmarks/mcts.py (stop string apart, as vLLM
    returns it); other prompts any text."""
    if "Question:" not in prompt:
        return "a long chain of thought \\boxed{5}", None
    from mcts import scripted_step

    completion = scripted_step(prompt, index)
    return completion.text, completion.stop_string


async def handle(replica: Replica, body: dict | None, path: str) -> tuple[int, dict]:
    if path.endswith("/models"):
        return 200, {"object": "list", "data": [{"id": "sim", "owned_by": "vllm"}]}
    if path.endswith("/stats"):
        return 200, replica.stats()
    if path.endswith("/reset"):
        replica.reset()
        return 200, {}
    chat = "messages" in body
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    n, seed = body.get("n", 1), body.get("seed") or 0
    lengths = [sequence_length(f"{prompt}|{seed + i}", body["max_tokens"]) for i in range(n)]
    await asyncio.gather(*(replica.add(length) for length in lengths))
    choices = []
    for i, length in enumerate(lengths):
        text, stop = scripted_text(prompt, seed + i)
        choice = {"index": i, "finish_reason": "stop" if length < body["max_tokens"] else "length",
                  "stop_reason": stop}  # fmt: skip
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if body.get("return_token_ids"):
            choice["token_ids"] = [0] * length
        choices.append(choice)
    usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": sum(lengths)}
    return 200, {"choices": choices, "usage": usage}


async def serve_replica(replica: Replica) -> int:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                length = int(headers.get("Content-Length") or headers.get("content-length") or 0)
                body = json.loads(await reader.readexactly(length)) if length else None
                status, answer = await handle(replica, body if method == "POST" else None, path)
                data = json.dumps(answer).encode()
                writer.write(
                    f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def clock() -> None:
        while True:
            replica.advance(replica.now())
            await asyncio.sleep(replica.tick_s)

    server = await asyncio.start_server(connection, "127.0.0.1", 0, limit=2**24, backlog=4096)
    replica.clock = asyncio.get_running_loop().create_task(clock())
    return server.sockets[0].getsockname()[1]


async def run_fleet(replicas: int, batch: int, tick_s: float) -> None:
    ports = [await serve_replica(Replica(batch, tick_s)) for _ in range(replicas)]
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


@contextmanager
def fleet(replicas: int, batch: int, tick_s: float):
    """Start the simulated fleet in a process of its own; yields its base URLs."""
    command = [sys.executable, __file__, "--serve", str(replicas), "--batch", str(batch),
               "--tick-ms", str(tick_s * 1000)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(process.stdout.readline())
        yield [f"http://127.0.0.1:{port}/v1" for port in ports]
    finally:
        process.kill()
        process.wait()


def busy_fraction(urls: list[str], tick_s: float) -> dict:
    """Decoded tokens over the fleet's ceiling from the first arrival: to the last sequence's
    end (`busy`, the whole run), and to the last sequence's start (`busy_until_drain`: after
    it the fleet can only drain, whoever drives it)."""
    import httpx

    stats = [httpx.get(f"{url}/stats", timeout=60).json() for url in urls]
    for url in urls:
        httpx.post(f"{url}/reset", json={}, timeout=60)
    spans = [s for st in stats for s in st["spans"]]
    capacity = sum(st["batch"] for st in stats)
    first = min(a for st in stats for a in st["arrivals"])
    last_start, last_end = max(s for s, _ in spans), max(e for _, e in spans)

    def busy(upto: int) -> float:
        decoded = sum(max(0, min(e, upto) - max(s, first)) for s, e in spans)
        return decoded / (capacity * max(1, upto - first))

    return {
        "busy": busy(last_end),
        "busy_until_drain": busy(last_start),
        "tokens": sum(e - s for s, e in spans),
        "sim_s": (last_end - first) * tick_s,
        "sequences": len(spans),
    }


# -- the drivers -------------------------------------------------------------------------------


def prompts_for(count: int, chat: bool, seed: int = 0) -> list:
    texts = [f"Problem {seed}-{i}: what is {i} + {i * 7 % 13}?" for i in range(count)]
    return [[{"role": "user", "content": t}] for t in texts] if chat else texts


def sequences_for(args, replicas: int) -> int:
    """Enough sequences that the run lasts `--fill` times the longest sequence."""
    mean = 0.15 + 0.85 * 0.225  # of max_tokens
    return round(args.fill * replicas * args.batch / mean)


def run_client(urls, args, replicas: int, *, chat: bool, n: int) -> dict:
    from rstar_pipelines.llm import SamplingParams, load_llm

    prompts = prompts_for(sequences_for(args, replicas) // n, chat)
    params = SamplingParams(n=n, temperature=0.8, max_tokens=args.max_tokens, seed=0)
    with closing(load_llm("openai", base_url=urls)) as llm:
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
    return {"wall_s": wall, **busy_fraction(urls, args.tick_ms / 1000)}


def run_stage(urls, args, replicas: int, *, n: int) -> dict:
    """`candidate_solutions` materialized by the `dagster` CLI, the pipeline pointed at the
    fleet through the RSTAR_LLM_* settings (as `rstar serve` prints them)."""
    import yaml

    problems = sequences_for(args, replicas) // n
    work = Path(tempfile.mkdtemp(prefix="llm-serving-"))
    try:
        assets = work / "assets"
        shutil.copytree(REPO / "assets", assets)
        doc = yaml.safe_load((assets / "pipeline.yaml").read_text())
        for entry in doc["assets"]:
            if entry["key"] == "synthesized_problems":
                entry["params"]["max_seeds_per_domain"] = 0  # the seeds, no LLM call
            if entry["key"] == "candidate_solutions":
                entry["params"]["sampling"].update(n=n, max_tokens=args.max_tokens)
        (assets / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        incoming = work / "data" / "seeds" / "incoming"
        incoming.mkdir(parents=True)
        seeds = [{"problem": f"What is {i} + {i % 17}?", "answer": str(i + i % 17)}
                 for i in range(problems)]  # fmt: skip
        (incoming / "b.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seeds))
        env = {**os.environ, "RSTAR_ASSETS_DIR": str(assets), "RSTAR_DATA_DIR": str(work / "data"),
               "DAGSTER_HOME": str(work / "home"), "RSTAR_LLM_BACKEND": "openai",
               "RSTAR_LLM_BASE_URL": ",".join(urls), "RSTAR_LLM_MODEL": "sim"}  # fmt: skip
        (work / "home").mkdir()
        (work / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        dagster = str(Path(sys.executable).parent / "dagster")

        def materialize(selection: str) -> float:
            command = [dagster, "asset", "materialize", "--select", selection, "--partition",
                       "b", "-m", "rstar_pipelines.definitions"]  # fmt: skip
            started = time.perf_counter()
            subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True)
            return time.perf_counter() - started

        subprocess.run([dagster, "instance", "migrate"], env=env, check=True, capture_output=True)
        add = ("import dagster as dg; i = dg.DagsterInstance.get(); "
               "i.add_dynamic_partitions('seed_batches', ['b'])")  # fmt: skip
        subprocess.run([sys.executable, "-c", add], env=env, check=True)
        materialize("seed_problems,seed_rejects,synthesized_problems")
        wall = materialize("candidate_solutions")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"wall_s": wall, **busy_fraction(urls, args.tick_ms / 1000)}


def run_mcts(urls, args, replicas: int, *, lockstep: bool, early: bool = True) -> dict:
    from mcts import InstantSandbox

    from rstar_pipelines.llm import load_llm
    from rstar_pipelines.math.mcts import MCTSConfig, MCTSSearch, Problem

    config = MCTSConfig(rollouts=4, width=4, max_depth=6, errors_threshold=1,
                        max_tokens=args.max_tokens, seed=0, lockstep=lockstep)  # fmt: skip
    trees = max(1, round(args.trees_per_slot * replicas * args.batch / config.width))
    problems = [Problem(f"t{i}", f"What is {i} + 5 - {i}?", "5") for i in range(trees)]
    with closing(load_llm("openai", base_url=urls)) as llm:
        search = MCTSSearch(llm, InstantSandbox(), config, descend_early=early)
        search.run(problems)
    wall = search.stats.wall_s
    return {"wall_s": wall, "trees": trees, "trees_per_hour": trees * 3600 / wall,
            "discarded_nodes": search.stats.discarded_nodes,
            **busy_fraction(urls, args.tick_ms / 1000)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the fleet's process
    parser.add_argument("--batch", type=int, default=128, help="sequences a replica decodes")
    parser.add_argument("--tick-ms", type=float, default=50.0, help="one token per tick")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fill", type=float, default=12.0,
                        help="workload length in units of the longest sequence")  # fmt: skip
    parser.add_argument("--trees-per-slot", type=float, default=1.5,
                        help="MCTS trees per `width` slots of the fleet")  # fmt: skip
    parser.add_argument("--only", choices=["client", "stage", "mcts"], action="append")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(run_fleet(args.serve, args.batch, args.tick_ms / 1000))
        return

    from rstar_sandbox.bench import machine

    only = set(args.only or ["client", "stage", "mcts"])
    rows = []
    for replicas in (1, 2):
        with fleet(replicas, args.batch, args.tick_ms / 1000) as urls:
            cases = []
            if "client" in only:
                cases += [(f"client, {'chat' if chat else 'raw'}, n={n}", run_client,
                           {"chat": chat, "n": n})
                          for chat in (False, True) for n in (1, 8)]  # fmt: skip
            if "stage" in only:
                cases += [(f"candidate_solutions (Dagster), chat, n={n}", run_stage, {"n": n})
                          for n in (1, 8)]  # fmt: skip
            if "mcts" in only:
                cases += [("MCTS, raw, width 4, lock-step", run_mcts, {"lockstep": True}),
                          ("MCTS, raw, width 4, asynchronous, whole expansions", run_mcts,
                           {"lockstep": False, "early": False}),
                          ("MCTS, raw, width 4, asynchronous, early walk", run_mcts,
                           {"lockstep": False})]  # fmt: skip
            for name, run, options in cases:
                row = {"replicas": replicas, "case": name, **run(urls, args, replicas, **options)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\nMachine: {machine()}; {time.strftime('%Y-%m-%d')}; replicas of batch {args.batch}, "
          f"{args.tick_ms:g} ms a token, max_tokens {args.max_tokens}\n")  # fmt: skip
    header = ["replicas", "driver", "sequences", "wall s", "busy (whole run)",
              "busy until the drain", "trees/h"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        trees = f"{r['trees_per_hour']:.0f}" if "trees_per_hour" in r else ""
        print(f"| {r['replicas']} | {r['case']} | {r['sequences']} | {r['wall_s']:.1f} | "
              f"{r['busy']:.3f} | {r['busy_until_drain']:.3f} | {trees} |")  # fmt: skip


if __name__ == "__main__":
    main()
