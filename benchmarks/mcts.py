"""MCTS engine throughput: node expansions/s, LLM calls per search, mean LLM batch size
against the trees still open, and the engine's own share of the wall time.

    python benchmarks/mcts.py [--trees 1000] [--model-trees 8] [--skip-model]

(a) A zero-latency scripted policy and an instant sandbox (every program "runs" at
    once): what is left is the engine (tree rules, answer checks, scheduling), on
    `--trees` trees.
(b) The embedded model (SmolLM2-135M on the CPU) with the real sandbox on the demo's
    math problems: the overhead that matters in practice.
Both schedules each time: asynchronous (the default: every pending request of a kind in
one batch, a tree resumes as soon as its own reply is back) and lock-step (the
reference's: one phase at a time for all trees). Prints Markdown for docs/benchmarks.md.
Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from rstar_pipelines.llm import Completion
from rstar_pipelines.math.mcts import MCTSConfig, MCTSSearch, Problem, StepPrompt
from rstar_pipelines.math.steps import ANSWER_END, CODE_END, STEP_END
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_sandbox import Result, Sandbox
from rstar_sandbox.bench import machine

REPO = Path(__file__).resolve().parent.parent


def scripted_step(prompt: str, sample: int) -> Completion:
    """A step chosen by a hash of the prompt and the sample: code steps, a step that closes
    the code, answers right and wrong — trees of realistic shape."""
    depth = prompt.count(STEP_END) + prompt.count(CODE_END)
    h = int(hashlib.blake2b(f"{prompt}|{sample}".encode(), digest_size=4).hexdigest(), 16)
    if CODE_END in prompt or depth >= 4:
        answer = "5" if h % 3 else str(h % 7)
        return Completion(f"\n<answer>\\boxed{{{answer}}}", "stop", ANSWER_END, 1, 1)
    if h % 4 == 0:
        return Completion(f"\nprint(x{depth})", "stop", CODE_END, 1, 1)
    return Completion(f"\nx{depth} = {h % 97}", "stop", STEP_END, 1, 1)


class ScriptedPolicy:
    """Instant completions from `scripted_step`."""

    name = "scripted"

    def generate(self, prompts, params):
        return [[scripted_step(prompt, i) for i in range(params.n)] for prompt in prompts]


class InstantSandbox:
    def run(self, jobs):
        return [Result("ok", 0, "5\n", "", 0.0, 0.0, 0.0) for _ in jobs]


def measure(policy, sandbox, problems, config, prompt) -> dict:
    search = MCTSSearch(policy, sandbox, config, prompt=prompt)
    trees = search.run(problems)
    s = search.stats
    return {
        "schedule": "lock-step" if config.lockstep else "asynchronous",
        "trees": len(trees),
        "nodes": sum(t.nodes.num_rows for t in trees),
        "expansions": s.expansions,
        "wall_s": s.wall_s,
        "expansions_per_s": s.expansions / s.wall_s if s.wall_s else 0.0,
        "llm_calls": s.llm_calls,
        "mean_llm_batch": s.mean_llm_batch,
        "mean_open_trees": s.mean_open_trees,
        "llm_s": s.llm_s,
        "sandbox_s": s.sandbox_s,
        "engine_s": s.engine_s,
        "engine_share": s.engine_s / s.wall_s if s.wall_s else 0.0,
    }


def table(rows: list[dict]) -> str:
    header = [
        "case",
        "schedule",
        "trees",
        "expansions",
        "wall s",
        "expansions/s",
        "LLM calls",
        "mean LLM batch",
        "mean open trees",
        "LLM s",
        "sandbox s",
        "engine s",
        "engine share",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['schedule']} | {r['trees']} | {r['expansions']} | "
            f"{r['wall_s']:.1f} | {r['expansions_per_s']:.1f} | {r['llm_calls']} | "
            f"{r['mean_llm_batch']:.1f} | {r['mean_open_trees']:.1f} | {r['llm_s']:.1f} | "
            f"{r['sandbox_s']:.2f} | {r['engine_s']:.2f} | {100 * r['engine_share']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--model-trees", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="sandbox backend for (b)")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()

    rows = []
    scripted = [Problem(f"s{i}", f"What is {i} + 5 - {i}?", "5") for i in range(args.trees)]
    prompt = StepPrompt(lambda q: f"Question: {q}\n")
    config = MCTSConfig(rollouts=8, width=4, max_depth=8, errors_threshold=1)
    for lockstep in (False, True):
        cfg = config.model_copy(update={"lockstep": lockstep})
        rows.append(
            {
                "case": "(a) scripted, instant sandbox",
                **measure(ScriptedPolicy(), InstantSandbox(), scripted, cfg, prompt),
            }
        )

    if not args.skip_model:
        from rstar_pipelines.llm import load_llm

        seeds = [json.loads(line) for line in (REPO / "assets/seeds/demo/demo.jsonl").open()]
        math_rows = [s for s in seeds if s["domain"] == "math"][: args.model_trees]
        problems = [Problem(f"m{i}", s["problem"], s["answer"]) for i, s in enumerate(math_rows)]
        template = PromptTemplate.load(REPO / "assets/prompts", "mcts_bootstrap.jinja")
        few_shot = StepPrompt(lambda q: template.render(question=q))
        llm = load_llm("transformers", "embedded", batch_size=32)
        config = MCTSConfig(
            rollouts=args.rollouts, width=3, max_depth=6, max_tokens=96, seed=0, exec_timeout_s=5.0
        )
        with Sandbox(backend=args.backend) as sandbox:
            for lockstep in (False, True):
                cfg = config.model_copy(update={"lockstep": lockstep})
                rows.append(
                    {
                        "case": "(b) embedded SmolLM2-135M, real sandbox",
                        **measure(llm, sandbox, problems, cfg, few_shot),
                    }
                )
    print(f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
