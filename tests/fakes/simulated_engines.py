"""Continuously batching LLM servers simulated on loopback, answering as the engines the openai
backend meets do; used by tests/llm/test_llm_fleet_window.py and benchmarks/llm_serving.py.

Each replica decodes up to `batch` sequences at once (its capacity, never told to the client),
each gaining one token per tick and freeing its slot when it ends; the rest wait in a
first-come queue. A sequence's length is drawn from its prompt and seed, long-tailed as long-CoT
sampling is: 85% stop between 5% and 40% of max_tokens, 15% run to max_tokens; sample i of a
request seeded s is seeded s + i, so every engine draws the same sequences for the same work.
The simulation is exact in ticks (a slot freed at tick t takes the next queued sequence at tick
t, however late the server's loop runs); a request is answered when its last sequence ends.

The engines (`ENGINES`), as real ones differ:
- "vllm": `/models` says `owned_by: "vllm"`, `n` and `return_token_ids` honoured, running and
  waiting requests on Prometheus `/metrics` (vLLM's gauge names).
- "usage-only": `n` honoured, token counts only in `usage` (SGLang without `--enable-metrics`,
  the OpenAI API, LMDeploy), no load report.
- "ignores-n": one choice whatever `n` (`transformers serve`, TGI), no load report.
- "llama.cpp": `n` > 1 refused with HTTP 500 as llama.cpp does, `/slots` listing its few slots
  (`-np 4`), the rest queued.

Run as `python -m tests.fakes.simulated_engines --serve vllm:128,vllm:128 --tick-ms 50`: the
fleet in a process of its own (so a client's work does not slow its clock), printing its ports
as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import heapq
import json
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.fakes.repo import REPO


@dataclass(frozen=True)
class Engine:
    owned_by: str
    n: str  # "honoured", "ignored" or "refused"
    token_ids: bool = False
    load: str | None = None  # "metrics" or "slots"


ENGINES = {
    "vllm": Engine("vllm", "honoured", token_ids=True, load="metrics"),
    "usage-only": Engine("sglang", "honoured"),
    "ignores-n": Engine("local", "ignored"),
    "llama.cpp": Engine("llamacpp", "refused", load="slots"),
}


class Replica:
    """One continuously batching server, simulated in ticks."""

    def __init__(self, engine: str, batch: int, tick_s: float):
        self.engine, self.batch, self.tick_s = ENGINES[engine], batch, tick_s
        self.origin = time.monotonic()
        self.reset()

    def reset(self) -> None:
        self.queue: list[tuple[int, int, int, asyncio.Future]] = []  # FIFO, popped from front
        self.running: list[tuple[int, int, asyncio.Future]] = []  # heap of (end, id, future)
        self.free_at: list[int] = [0] * self.batch  # heap: tick at which each slot frees
        self.spans: list[tuple[int, int]] = []  # (start, end) tick of every sequence
        self.arrivals: list[tuple[int, int, int]] = []  # (tick, id, length) of every sequence
        self.requests = 0
        self._ids = 0

    def now(self) -> int:
        return int((time.monotonic() - self.origin) / self.tick_s)

    def add(self, length: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        tick = self.now()
        self._ids += 1
        self.arrivals.append((tick, self._ids, length))
        self.queue.append((tick, self._ids, length, future))
        self.advance(tick)
        return future

    def advance(self, tick: int) -> None:
        """Run the simulation up to `tick`: queued sequences take slots as slots free."""
        while self.queue and self.free_at and self.free_at[0] <= tick:
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

    def resize(self, batch: int) -> None:
        """A replica restarted on other hardware: `batch` slots from now on. Slots taken away
        are those that free first; their sequences run to their end."""
        tick = self.now()
        self.advance(tick)
        if batch < self.batch:
            self.free_at = sorted(self.free_at)[self.batch - batch :]
            heapq.heapify(self.free_at)
        for _ in range(batch - self.batch):
            heapq.heappush(self.free_at, tick)
        self.batch = batch
        self.advance(tick)

    def decoding(self) -> int:
        self.advance(self.now())
        return len(self.running)

    def stats(self) -> dict:
        return {"spans": self.spans, "arrivals": self.arrivals, "batch": self.batch,
                "requests": self.requests}  # fmt: skip


def sequence_length(key: str, max_tokens: int) -> int:
    rng = random.Random(key)
    if rng.random() < 0.15:
        return max_tokens
    return max(1, round(max_tokens * rng.uniform(0.05, 0.4)))


def scripted_text(prompt: str, seed: int, length: int) -> tuple[str, str | None]:
    """MCTS prompts get the scripted steps of benchmarks/mcts.py (stop string apart, as vLLM
    returns it); other prompts a text as long as the sequence."""
    if "Question:" not in prompt:
        return "a long chain of thought" + " step" * length + " \\boxed{5}", None
    completion = scripted_steps()(prompt, seed)
    return completion.text, completion.stop_string


@functools.cache
def scripted_steps():
    """benchmarks/mcts.py's scripted policy, looked up once. Its import takes seconds (it loads
    the package): the fleet makes it before it serves, not while its first answer waits."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from mcts import scripted_step

    return scripted_step


def load_page(replica: Replica) -> tuple[int, list | str]:
    """What the engine says of its load: vLLM's gauges, or llama.cpp's slots."""
    running = replica.decoding()
    if replica.engine.load == "metrics":
        page = "".join(
            f"# TYPE vllm:num_requests_{name} gauge\n"
            f'vllm:num_requests_{name}{{engine="0",model_name="sim"}} {value:.1f}\n'
            for name, value in (("running", running), ("waiting", len(replica.queue)))
        )
        return 200, page
    return 200, [{"id": i, "is_processing": i < running} for i in range(replica.batch)]


async def handle(replica: Replica, body: dict | None, path: str) -> tuple[int, dict | list | str]:
    engine = replica.engine
    if path.endswith("/models"):
        return 200, {"object": "list", "data": [{"id": "sim", "owned_by": engine.owned_by}]}
    if path.endswith(("/metrics", "/slots")):
        wanted = "metrics" if path.endswith("/metrics") else "slots"
        return load_page(replica) if engine.load == wanted else (404, {"error": "not found"})
    if path.endswith("/stats"):
        return 200, replica.stats()
    if path.endswith("/reset"):
        replica.reset()
        return 200, {}
    if path.endswith("/resize"):
        replica.resize(body["batch"])
        return 200, {}
    replica.requests += 1
    n = body.get("n", 1)
    if n > 1 and engine.n == "refused":
        return 500, {"error": {"code": 500, "message": "Only one completion choice is allowed"}}
    return 200, await complete(replica, body, n if engine.n == "honoured" else 1)


async def complete(replica: Replica, body: dict, n: int) -> dict:
    chat = "messages" in body
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    seed = body.get("seed") or 0
    lengths = [sequence_length(f"{prompt}|{seed + i}", body["max_tokens"]) for i in range(n)]
    await asyncio.gather(*(replica.add(length) for length in lengths))
    choices = []
    for i, length in enumerate(lengths):
        text, stop = scripted_text(prompt, seed + i, length)
        choice = {"index": i, "finish_reason": "stop" if length < body["max_tokens"] else "length",
                  "stop_reason": stop}  # fmt: skip
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if replica.engine.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = [0] * length
        choices.append(choice)
    usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": sum(lengths)}
    return {"choices": choices, "usage": usage}


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
                plain = isinstance(answer, str)
                data = (answer if plain else json.dumps(answer)).encode()
                kind = "text/plain; version=0.0.4" if plain else "application/json"
                writer.write(
                    f"HTTP/1.1 {status} OK\r\nContent-Type: {kind}\r\n"
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


async def run_fleet(replicas: list[tuple[str, int]], tick_s: float) -> None:
    scripted_steps()
    ports = [await serve_replica(Replica(engine, batch, tick_s)) for engine, batch in replicas]
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


@contextmanager
def fleet(replicas: list[tuple[str, int]], tick_s: float):
    """Start the simulated fleet, replicas given as (engine, batch), in a process of its own;
    yields their base URLs."""
    spec = ",".join(f"{engine}:{batch}" for engine, batch in replicas)
    command = [sys.executable, "-m", "tests.fakes.simulated_engines", "--serve", spec,
               "--tick-ms", str(tick_s * 1000)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        ports = json.loads(process.stdout.readline())
        yield [f"http://127.0.0.1:{port}/v1" for port in ports]
    finally:
        process.kill()
        process.wait()


def fleet_stats(urls: list[str], reset: bool = True) -> list[dict]:
    """Each replica's record (sequences' spans and arrivals, requests, batch); then cleared."""
    stats = [httpx.get(f"{url}/stats", timeout=60).json() for url in urls]
    if reset:
        for url in urls:
            httpx.post(f"{url}/reset", json={}, timeout=60)
    return stats


def busy_fraction(stats: list[dict], tick_s: float) -> dict:
    """Decoded tokens over the fleet's ceiling from the first arrival: to the last sequence's
    end (`busy`, the whole run), and to the last sequence's start (`busy_until_drain`: after
    it the fleet can only drain, whoever drives it). `perfect`: the busy fraction of a perfect
    client on the same sequences (every one at a server when the first arrives, in the order
    they arrived, on the fleet's slots as one first-come queue), and `of_perfect` the ratio."""
    spans = [s for st in stats for s in st["spans"]]
    capacity = sum(st["batch"] for st in stats)
    first = min(a[0] for st in stats for a in st["arrivals"])
    last_start, last_end = max(s for s, _ in spans), max(e for _, e in spans)
    tokens = sum(e - s for s, e in spans)

    def busy(upto: int) -> float:
        decoded = sum(max(0, min(e, upto) - max(s, first)) for s, e in spans)
        return decoded / (capacity * max(1, upto - first))

    slots = [0] * capacity
    for _, _, length in sorted(a for st in stats for a in st["arrivals"]):
        heapq.heapreplace(slots, slots[0] + length)
    perfect = tokens / (capacity * max(slots))
    whole = busy(last_end)
    return {"busy": whole, "busy_until_drain": busy(last_start), "perfect": perfect,
            "of_perfect": whole / perfect, "tokens": tokens, "sim_s": (last_end - first) * tick_s,
            "sequences": len(spans), "requests": sum(st["requests"] for st in stats)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="serve a simulated fleet")
    parser.add_argument("--serve", required=True, help="ENGINE:BATCH,... (engines: ENGINES)")
    parser.add_argument("--tick-ms", type=float, default=50.0, help="one token per tick")
    args = parser.parse_args()
    replicas = [(engine, int(batch)) for engine, batch in
                (item.split(":") for item in args.serve.split(","))]  # fmt: skip
    asyncio.run(run_fleet(replicas, args.tick_ms / 1000))


if __name__ == "__main__":
    main()
