"""How busy the LLM layer keeps a fleet of continuously batching servers of each engine the
openai backend meets: throughput against what a perfect client achieves on the same sequences,
through the client, through `candidate_solutions` in Dagster, and MCTS trees/hour against the
reference's lock-step schedule.

    python benchmarks/llm_serving.py [--tick-ms 50] [--max-tokens 128] [--fill 12]
        [--engine vllm --engine llama.cpp ...] [--only client|stage|mcts] [--fixed-window 1024]
        [--trees-per-slot 1] [--rollouts-in-flight 4]

The fleet is simulated on loopback in a process of its own (tests/fakes/simulated_engines.py): vLLM
(token ids, load on `/metrics`), an engine that answers `n` choices with usage only, one that
ignores `n`, and llama.cpp with 4 slots that queues the rest (`/slots`), each with its own
capacity (`CAPACITY`), never told to the client. Every run uses the client's defaults (no
window or `n` setting given); `--fixed-window` adds client rows with every window held at that
many sequences, the baseline the adaptive window is measured against.

Busy fraction = tokens decoded / (replicas x capacity x ticks), from the first request's
arrival to the last sequence's end: the drain at the end of a finite workload counts against it
(the table also gives it up to the last sequence's start, where the drain begins). "Of perfect"
divides it by the busy fraction a perfect client gets on the same sequences: all of them at the
servers when the first arrives, in the same order, the fleet's slots taking them first-come.
Each row also gives the window the client settled at per replica, and the requests the servers
answered. Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from tests.fakes.simulated_engines import busy_fraction, fleet, fleet_stats  # noqa: E402

# Sequences each engine's replica decodes at once (its capacity; the client is not told).
CAPACITY = {"vllm": 128, "usage-only": 96, "ignores-n": 64, "llama.cpp": 4}


# -- the drivers -------------------------------------------------------------------------------


def prompts_for(count: int, chat: bool, seed: int = 0) -> list:
    texts = [f"Problem {seed}-{i}: what is {i} + {i * 7 % 13}?" for i in range(count)]
    return [[{"role": "user", "content": t}] for t in texts] if chat else texts


def sequences_for(args, slots: int) -> int:
    """Enough sequences that the run lasts `--fill` times the longest sequence on `slots`."""
    mean = 0.15 + 0.85 * 0.225  # of max_tokens
    return round(args.fill * slots / mean)


def measured(urls, args, wall: float, windows: list[int] | None = None) -> dict:
    figures = busy_fraction(fleet_stats(urls), args.tick_ms / 1000)
    return {"wall_s": wall, "windows": windows or [], **figures}


@contextmanager
def fixed_windows(limit: int | None):
    """With `limit`: every server's window held at `limit` sequences (the baseline of a window
    declared per engine), else the adaptive window."""
    from rstar_pipelines.llm import openai_backend
    from rstar_pipelines.llm.fleet_window import AdaptiveWindow

    class FixedWindow(AdaptiveWindow):
        def __init__(self, cap: int | None = None, reports_load: bool = False):
            super().__init__(cap, reports_load)
            self.limit, self.growing_fast = limit, False

        def observe(self, load, in_flight: int) -> None:
            pass

        def decide(self) -> None:
            pass

    if limit is None:
        yield
        return
    openai_backend.AdaptiveWindow = FixedWindow
    try:
        yield
    finally:
        openai_backend.AdaptiveWindow = AdaptiveWindow


def run_client(urls, args, slots: int, *, chat: bool, n: int, fixed: int | None = None) -> dict:
    from rstar_pipelines.llm import SamplingParams, load_llm

    prompts = prompts_for(sequences_for(args, slots) // n, chat)
    params = SamplingParams(n=n, temperature=0.8, max_tokens=args.max_tokens, seed=0)
    with fixed_windows(fixed), closing(load_llm("openai", base_url=urls)) as llm:
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
        windows = [s["window"] for s in llm.server_stats().values()]
    return measured(urls, args, wall, windows)


def run_stage(urls, args, slots: int, *, n: int) -> dict:
    """`candidate_solutions` materialized by the `dagster` CLI, the pipeline pointed at the
    fleet through the RSTAR_LLM_* settings (as `rstar serve` prints them)."""
    import yaml

    problems = sequences_for(args, slots) // n
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
    return measured(urls, args, wall)


def mcts_config(args, lockstep: bool = False, in_flight: int = 1):
    from rstar_pipelines.math.mcts import MCTSConfig

    return MCTSConfig(rollouts=4, width=4, max_depth=6, errors_threshold=1,
                      max_tokens=args.max_tokens, seed=0, lockstep=lockstep,
                      rollouts_in_flight=in_flight)  # fmt: skip


def mcts_trees(args, slots: int) -> int:
    return max(1, round(args.trees_per_slot * slots))


def run_mcts(
    urls, args, slots: int, *, lockstep: bool, early: bool = True, in_flight: int = 1
) -> dict:
    """The search engine alone (`MCTSSearch.run`, trees opened as the fleet has room)."""
    from mcts import InstantSandbox

    from rstar_pipelines.llm import load_llm
    from rstar_pipelines.math.mcts import MCTSSearch, Problem

    trees = mcts_trees(args, slots)
    problems = [Problem(f"t{i}", f"What is {i} + 5 - {i}?", "5") for i in range(trees)]
    with closing(load_llm("openai", base_url=urls)) as llm:
        config = mcts_config(args, lockstep, in_flight)
        search = MCTSSearch(llm, InstantSandbox(), config, descend_early=early)
        search.run(problems, on_tree=lambda i, tree, seconds: None)
        windows = [s["window"] for s in llm.server_stats().values()]
    wall = search.stats.wall_s
    return {"trees": trees, "trees_per_hour": trees * 3600 / wall,
            **measured(urls, args, wall, windows)}  # fmt: skip


def run_search_stage(urls, args, slots: int, *, key: str, in_flight: int = 1) -> dict:
    """`mcts_trajectories` (the training side of the split) or `mcts_eval` (the held-out side,
    without a PPM: evaluation mode, and its greedy pass) materialized by Dagster in this
    process, the upstream tables written to a lake of its own, the `llm` resource on the fleet
    and a sandbox that answers at once (as the engine rows')."""
    import dagster as dg
    import pyarrow as pa
    import yaml
    from mcts import InstantSandbox

    from rstar_pipelines.definitions import build_definitions, load_spec
    from rstar_pipelines.llm.resource import LLMResource
    from rstar_pipelines.sandbox_resource import SandboxResource
    from rstar_pipelines.storage import schemas
    from rstar_pipelines.storage.parquet_io import write_table

    class InstantSandboxResource(SandboxResource):
        def get(self):
            return InstantSandbox()

    trees = mcts_trees(args, slots)
    work = Path(tempfile.mkdtemp(prefix="llm-serving-mcts-"))
    saved = {k: os.environ.get(k) for k in ("RSTAR_DATA_DIR", "RSTAR_LAKE_URL", "RSTAR_ASSETS_DIR")}
    try:
        assets = work / "assets"
        shutil.copytree(REPO / "assets", assets)
        # The engine rows' prompt (mcts.DEFAULT_PROMPT), not the few-shot one, whose example
        # steps the simulated engines would count as the tree's depth.
        (assets / "prompts" / "mcts_bootstrap.jinja").write_text("Question: {{ question }}\n")
        os.environ.update(RSTAR_DATA_DIR=str(work / "data"), RSTAR_ASSETS_DIR=str(assets))
        os.environ.pop("RSTAR_LAKE_URL", None)
        doc = yaml.safe_load((assets / "pipeline.yaml").read_text())
        config = mcts_config(args, in_flight=in_flight)
        config = config.model_dump(mode="json", exclude={"lockstep"})
        # mcts_eval searches the held-out side: all of it when every group is held out
        doc["heldout"]["fraction"] = 0.0 if key == "mcts_trajectories" else 0.999999
        paired = next(e["upstream"] for e in doc["assets"] if e["key"] == "eval_comparison")
        for entry in doc["assets"]:
            if entry["key"] == key:
                entry["params"].update(search=config, max_problems=trees, prompt="bootstrap")
            elif entry["key"] in paired and "max_problems" in entry.get("params", {}):
                # the comparison pairs the evaluations over one declared set of problems
                entry["params"]["max_problems"] = trees
        (assets / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        spec = load_spec()
        defs = build_definitions(spec)
        lake = work / "data" / "lake"
        _write_search_upstream(lake, trees, schemas, write_table, pa)
        llm = LLMResource(backend="openai", base_urls=list(urls), model="sim")
        resources = {**defs.resources, "sandbox": InstantSandboxResource(), "llm": llm}
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("seed_batches", ["b"])
            started = time.perf_counter()
            result = dg.materialize(
                list(defs.assets), selection=[key], instance=instance, resources=resources,
                partition_key="b" if key == "mcts_trajectories" else None)  # fmt: skip
            wall = time.perf_counter() - started
            assert result.success
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(work, ignore_errors=True)
    return {"trees": trees, "trees_per_hour": trees * 3600 / wall,
            **measured(urls, args, wall)}  # fmt: skip


def _write_search_upstream(lake: Path, trees: int, schemas, write_table, pa) -> None:
    """Seed batch "b": `trees` verified maths problems (each its own group) and the tables the
    search stages read beside them; checkpoints without a path (the declared policy, no PPM)."""
    ids = [f"t{i}" for i in range(trees)]
    problems = [{"id": i, "batch": "b", "domain": "math", "problem": f"What is {n} + 5 - {n}?",
                 "answer": "5", "oracle_solutions": [], "examples": [], "time_limit_s": None,
                 "is_seed": True, "seed_id": i, "model": "seed"}
                for n, i in enumerate(ids)]  # fmt: skip
    verified = [{"problem_id": i, "batch": "b", "domain": "math", "verified": True,
                 "reason": None, "label_source": "given", "agreement": 1.0, "answer": "5",
                 "inputs": [], "labels": [], "candidates": []} for i in ids]  # fmt: skip
    groups = [{"problem_id": i, "batches": ["b"], "domain": "math", "seed_id": i, "group_id": i,
               "group_size": 1, "heldout": True, "duplicate_of": None} for i in ids]  # fmt: skip
    write_table(pa.Table.from_pylist(problems, schema=schemas.SYNTHESIZED_PROBLEMS),
                lake / "synthesized_problems" / "b.parquet")  # fmt: skip
    write_table(pa.Table.from_pylist(verified, schema=schemas.VERIFIED_OUTPUTS),
                lake / "verified_outputs" / "b.parquet")  # fmt: skip
    write_table(pa.Table.from_pylist(groups, schema=schemas.PROBLEM_GROUPS),
                lake / "problem_groups.parquet")  # fmt: skip
    for name in ("policy_checkpoint", "ppm_checkpoint"):
        row = {field.name: None for field in schemas.CHECKPOINT}
        write_table(pa.Table.from_pylist([row], schema=schemas.CHECKPOINT),
                    lake / f"{name}.parquet")  # fmt: skip


def cases_for(
    engine: str, only: set[str], fixed: int | None, in_flight: int = 1
) -> list[tuple[str, object, dict]]:
    cases = []
    if "client" in only:
        cases += [(f"client, {'chat' if chat else 'raw'}, n={n}", run_client,
                   {"chat": chat, "n": n}) for chat, n in ((False, 1), (True, 8))]  # fmt: skip
        if fixed:
            cases += [(f"client, fixed window {fixed}, {'chat' if chat else 'raw'}, n={n}",
                       run_client, {"chat": chat, "n": n, "fixed": fixed})
                      for chat, n in ((False, 1), (True, 8))]  # fmt: skip
    if "stage" in only:
        cases += [("candidate_solutions (Dagster), chat, n=8", run_stage, {"n": 8})]
    if "mcts" in only and engine == "vllm":
        cases += [("MCTS engine, lock-step", run_mcts, {"lockstep": True}),
                  ("MCTS engine, early walk", run_mcts, {"lockstep": False}),
                  ("mcts_trajectories (Dagster)", run_search_stage, {"key": "mcts_trajectories"}),
                  ("mcts_eval (Dagster)", run_search_stage, {"key": "mcts_eval"})]  # fmt: skip
        if in_flight > 1:  # the declared departure (MCTSConfig.rollouts_in_flight)
            cases += [(f"MCTS engine, {in_flight} rollouts in flight", run_mcts,
                       {"lockstep": False, "in_flight": in_flight})] + [
                      (f"{key} (Dagster), {in_flight} rollouts in flight", run_search_stage,
                       {"key": key, "in_flight": in_flight})
                      for key in ("mcts_trajectories", "mcts_eval")]  # fmt: skip
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tick-ms", type=float, default=50.0, help="one token per tick")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fill", type=float, default=12.0,
                        help="workload length in units of the longest sequence")  # fmt: skip
    parser.add_argument("--trees-per-slot", type=float, default=1.0,
                        help="MCTS trees (problems) per slot of the fleet")  # fmt: skip
    parser.add_argument("--capacity", type=int, help="every replica's, instead of CAPACITY's")
    parser.add_argument("--engine", choices=list(CAPACITY), action="append")
    parser.add_argument("--replicas", type=int, choices=[1, 2], action="append")
    parser.add_argument("--only", choices=["client", "stage", "mcts"], action="append")
    parser.add_argument(
        "--fixed-window", type=int, help="client rows with windows held at this many too"
    )
    parser.add_argument("--rollouts-in-flight", type=int, default=1,
                        help="MCTS rows with this many rollouts of a tree at once too")  # fmt: skip
    args = parser.parse_args()

    from rstar_sandbox.bench import machine

    only = set(args.only or ["client", "stage", "mcts"])
    rows = []
    for engine in args.engine or list(CAPACITY):
        for replicas in args.replicas or [1, 2]:
            capacity = args.capacity or CAPACITY[engine]
            replica_specs = [(engine, capacity)] * replicas
            with fleet(replica_specs, args.tick_ms / 1000) as urls:
                for name, run, options in cases_for(
                    engine, only, args.fixed_window, args.rollouts_in_flight
                ):
                    figures = run(urls, args, replicas * capacity, **options)
                    row = {"engine": engine, "capacity": capacity, "replicas": replicas,
                           "case": name, **figures}  # fmt: skip
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print(f"\nMachine: {machine()}; {time.strftime('%Y-%m-%d')}; {args.tick_ms:g} ms a token, "
          f"max_tokens {args.max_tokens}, fill {args.fill:g}\n")  # fmt: skip
    header = ["engine (capacity)", "replicas", "driver", "sequences", "requests", "wall s",
              "window", "busy (whole run)", "busy until the drain", "of perfect",
              "trees/h"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        if "trees_per_hour" in r:
            continue  # in the MCTS table
        trees = ""
        windows = ", ".join(str(w) for w in r["windows"])
        print(f"| {r['engine']} ({r['capacity']}) | {r['replicas']} | {r['case']} | "
              f"{r['sequences']} | {r['requests']} | {r['wall_s']:.1f} | {windows} | "
              f"{r['busy']:.3f} | {r['busy_until_drain']:.3f} | {r['of_perfect']:.3f} | "
              f"{trees} |")  # fmt: skip

    print_mcts_table([r for r in rows if "trees_per_hour" in r])


def print_mcts_table(rows: list[dict]) -> None:
    """The search rows: busy, busy of the ceiling (a perfect client on the same sequences),
    trees/h, and the lock-step engine's trees/h on the same fleet beside them."""
    if not rows:
        return
    lockstep = {(r["capacity"], r["replicas"]): r["trees_per_hour"]
                for r in rows if r["case"] == "MCTS engine, lock-step"}  # fmt: skip
    header = ["capacity", "replicas", "driver", "trees", "sequences", "wall s",
              "busy (whole run)", "busy until the drain", "of the ceiling", "trees/h",
              "lock-step trees/h", "x lock-step"]  # fmt: skip
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        base = lockstep.get((r["capacity"], r["replicas"]))
        ratio = f"{r['trees_per_hour'] / base:.2f}" if base else ""
        print(f"| {r['capacity']} | {r['replicas']} | {r['case']} | {r['trees']} | "
              f"{r['sequences']} | {r['wall_s']:.1f} | {r['busy']:.3f} | "
              f"{r['busy_until_drain']:.3f} | {r['of_perfect']:.3f} | "
              f"{r['trees_per_hour']:.0f} | {base or 0:.0f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
