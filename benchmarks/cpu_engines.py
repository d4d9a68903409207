"""The embedded model's generation on the CPU, engine against engine: our transformers backend
with the CPU speed-ups (package `llm.cpu`) on and off, llama.cpp's `llama-server` serving the same
GGUF file behind our openai backend, and the plain transformers path with torchao's or
optimum-quanto's quantized weights.

    python benchmarks/cpu_engines.py --llama-server PATH [--rounds 3] [--systems ...]

`--llama-server` (or LLAMA_SERVER) names a llama-server binary (llama.cpp's `tools/server`, built
from source: no wheel or Debian package carries it); without one its rows are skipped with a
message. torchao and optimum-quanto rows are skipped where the package is not installed.

The workloads are the demo's generation calls, with the demo's sampling (assets/pipeline.yaml):
`candidate_solutions` (8 math problems, solve_math.jinja, 3 samples each), a batch of MCTS
expansions (8 trees' bootstrap prompts, mcts_bootstrap.jinja, `width` samples of one step each,
stopped at the step's end), and one greedy sequence. Each is one `generate()` call; tokens/s is
the completions' tokens over the call's wall time, prefill included. The engines sample
differently (llama.cpp's sampler chain against transformers' top-k 50), so their completions
differ in length: compare tokens/s, not wall.

Every round runs every (workload, system) once, the systems in an order rotated each round, so
a machine shared with other work loads them alike; each figure is paired with the CPU room's in
the same round, and the table gives medians over rounds. Not a test: figures depend on the
machine and its load, which the script prints.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from benchmarks.embedded_generation import load_average
from benchmarks.shared_prefill import prompts as bootstrap_prompts
from rstar_pipelines.llm import SamplingParams, embedded_model_path, load_llm
from rstar_pipelines.math.steps import BOOTSTRAP_STOPS
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_sandbox.bench import machine

REPO = Path(__file__).resolve().parent.parent
# Our transformers backend with the CPU room on (int4 weights) and off (float32, generate()).
ROOM = "cpu-room"
SYSTEMS = (ROOM, "plain", "llama-server", "torchao-int8", "quanto-int8")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    params: SamplingParams


def _stage_params(key: str) -> dict:
    spec = yaml.safe_load((REPO / "assets" / "pipeline.yaml").read_text())
    return next(a["params"] for a in spec["assets"] if a["key"] == key)


def workloads(problems: int, max_tokens: int | None) -> list[Workload]:
    """The demo's calls, each completion cut at `max_tokens` where given."""
    loads = _demo_workloads(problems)
    if max_tokens is None:
        return loads
    return [
        Workload(w.name, w.prompts, w.params.model_copy(update={"max_tokens": max_tokens}))
        for w in loads
    ]


def _demo_workloads(problems: int) -> list[Workload]:
    seeds = (REPO / "assets" / "seeds" / "demo" / "demo.jsonl").read_text().splitlines()
    math = [json.loads(line)["problem"] for line in seeds if '"math"' in line]
    solve = PromptTemplate.load(REPO / "assets" / "prompts", "solve_math.jinja")
    search = _stage_params("mcts_trajectories")["search"]
    expansion = SamplingParams(
        n=search["width"],
        temperature=search["temperature"],
        max_tokens=search["max_tokens"],
        stop=BOOTSTRAP_STOPS,
        seed=0,
    )
    return [
        Workload(
            f"candidate_solutions: {problems} problems x 3",
            [solve.render(problem=p) for p in math[8 : 8 + problems]],
            SamplingParams(**_stage_params("candidate_solutions")["sampling"]),
        ),
        Workload(
            f"MCTS expansions: {problems} trees x {search['width']}",
            bootstrap_prompts(problems),
            expansion,
        ),
        Workload(
            "1 sequence, greedy",
            [solve.render(problem=math[8])],
            SamplingParams(temperature=0, max_tokens=128),
        ),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(binary: str, slots: int, context: int, threads: int) -> Iterator[str]:
    """A llama-server on loopback serving the embedded GGUF file as shipped; its /v1 URL."""
    port = _free_port()
    command = [binary, "-m", str(embedded_model_path()), "--host", "127.0.0.1"]
    command += ["--port", str(port), "-t", str(threads), "-tb", str(threads)]
    command += ["-np", str(slots), "-c", str(slots * context), "--no-webui"]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                health = f"http://127.0.0.1:{port}/health"
                with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2):
                    break
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"llama-server did not come up: {command}\n{tail}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            server.terminate()
            server.wait(30)


def _quantize_int8(library: str, model: object) -> object:
    """`model` with its decoder layers' linear layers on int8 weights by `library` (the LM
    head, tied to the embeddings, stays)."""
    layers = model.model.layers
    if library == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(layers, Int8WeightOnlyConfig())
    else:
        from optimum.quanto import freeze, qint8, quantize

        quantize(layers, weights=qint8)
        freeze(layers)
    return model


def _quantized_plain(library: str) -> Callable[[], object]:
    """The plain transformers path over a copy of the model quantized by `library`."""
    from rstar_pipelines.llm.transformers_backend import TransformersLLM, load_prepared

    class Quantized(TransformersLLM):
        @staticmethod
        def load_model_and_tokenizer(model, device, dtype, seer, quantization):
            prepare = functools.partial(_quantize_int8, library)
            return load_prepared(model, device, dtype, seer, f"{library}-int8", prepare)

    return lambda: Quantized("embedded", batch_size=16)


def _installed(library: str) -> bool:
    if library == "quanto":
        return importlib.util.find_spec("optimum") is not None and bool(
            importlib.util.find_spec("optimum.quanto")
        )
    return importlib.util.find_spec(library) is not None


def build_systems(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, object]:
    wanted = args.systems.split(",") if args.systems else list(SYSTEMS)
    builders: dict[str, Callable[[], object]] = {
        ROOM: lambda: load_llm("transformers", "embedded", cpu_speedups=True, batch_size=16),
        "plain": lambda: load_llm("transformers", "embedded", cpu_speedups=False, batch_size=16),
        "torchao-int8": _quantized_plain("torchao"),
        "quanto-int8": _quantized_plain("quanto"),
    }
    systems = {}
    for name in wanted:
        if name == "llama-server":
            binary = args.llama_server or os.environ.get("LLAMA_SERVER") or "llama-server"
            if shutil.which(binary) is None:
                print(f"llama-server: skipped, no binary {binary!r} (--llama-server PATH)")
                continue
            url = stack.enter_context(llama_server(binary, args.slots, args.context, args.threads))
            systems[name] = stack.enter_context(
                contextlib.closing(load_llm("openai", base_url=url))
            )
        elif name not in builders:
            raise SystemExit(f"--systems: unknown system {name!r}; expected {', '.join(SYSTEMS)}")
        elif name.endswith("-int8") and not _installed(name.split("-")[0]):
            print(f"{name}: skipped, the package is not installed")
        else:
            systems[name] = builders[name]()
    return systems


def run(llm, workload: Workload) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(workload.prompts, workload.params)
    seconds = time.perf_counter() - start
    return seconds, sum(c.completion_tokens for samples in results for c in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="llama-server binary (default: LLAMA_SERVER)")
    parser.add_argument("--systems", help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--problems", type=int, default=8, help="prompts per batched call")
    parser.add_argument("--max-tokens", type=int, help="cap every call's (default: the demo's)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    parser.add_argument("--context", type=int, default=1024, help="llama-server's tokens a slot")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch's and llama-server's"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        systems = build_systems(args, stack)
        measured = _measure(systems, workloads(args.problems, args.max_tokens), args.rounds)
    print(f"machine: {machine()}, torch {torch.__version__}, {args.threads} threads")
    print(f"load average before: {load_before}; after: {load_average()}")
    print(f"rounds: {args.rounds}; llama-server: {args.slots} slots of {args.context} tokens\n")
    print(f"| workload | system | tokens/s (median) | range | wall s (median) | / {ROOM} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (workload, system), rows in measured.items():
        rates = [tokens / seconds for seconds, tokens, _ in rows]
        ratio = statistics.median(r for _, _, r in rows)
        print(
            f"| {workload} | {system} | {statistics.median(rates):.1f} | "
            f"{min(rates):.1f}-{max(rates):.1f} | "
            f"{statistics.median(s for s, _, _ in rows):.1f} | {ratio:.2f} |"
        )


def _measure(
    systems: dict[str, object], loads: list[Workload], rounds: int
) -> dict[tuple[str, str], list[tuple[float, int, float]]]:
    """(seconds, tokens, tokens/s over the CPU room's in the same round) per (workload,
    system), every round running the systems in a rotated order."""
    names = list(systems)
    first = loads[-1]
    warm = Workload(first.name, first.prompts, first.params.model_copy(update={"max_tokens": 8}))
    for name in names:  # a first call per system: lazy loading, kernel builds
        run(systems[name], warm)
    measured: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for workload in loads:
            figures = {}
            for name in order:
                figures[name] = run(systems[name], workload)
                seconds, tokens = figures[name]
                print(
                    f"round {round_ + 1}, {workload.name}, {name}: {tokens} tokens in "
                    f"{seconds:.1f} s",
                    flush=True,
                )
            room = figures[ROOM][1] / figures[ROOM][0] if ROOM in figures else float("nan")
            for name in names:
                seconds, tokens = figures[name]
                key = (workload.name, name)
                measured.setdefault(key, []).append((seconds, tokens, tokens / seconds / room))
    return measured


if __name__ == "__main__":
    main()
