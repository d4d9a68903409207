"""grpo_eval: the round's GRPO-RoC policy on the held-out problems, greedy, two ways: one turn
without its tool, and with its Python tool as in its training rollouts. The gold answer (or the
verified tests) only grades the final turn."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.agent.format import agent_prompt, final_answer
from rstar_pipelines.agent.reward import AgentProblem, rewards
from rstar_pipelines.agent.rollout import RolloutConfig, Trajectory, run_rollouts
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
)
from rstar_pipelines.problems import (
    VerifiedProblem,
    first_of_each_domain,
    on_side,
    verified_problems,
)
from rstar_pipelines.storage import schemas

# method -> how many turns it may take (None: the rollout config's)
METHODS = {"greedy": 1, "tool": None}


class GRPOEvalParams(StageParams):
    round: int = Field(1, ge=1)
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    max_problems: int | None = Field(None, ge=1, description="at most this many of each domain")
    rollout: RolloutConfig = Field(
        RolloutConfig(temperature=0.0),
        description="the training rollouts' limits, at temperature 0 (greedy)",
    )


def agent_problem(problem: VerifiedProblem) -> AgentProblem:
    return AgentProblem(
        problem.id, problem.domain, problem.question, problem.answer, problem.inputs, problem.labels
    )


class GRPOEvaluation(Stage):
    """The round's GRPO-RoC policy on the held-out verified problems (math and code): greedy in
    one turn (a tool call it makes is not run), and greedy with its Python tool over as many turns
    as its training rollouts; each graded by the training reward (math-verify, or the verified
    tests)."""

    Params = GRPOEvalParams
    schema = schemas.GRPO_EVAL
    prompt_roles = ("agent_system", "agent_user")
    resources = ("llm", "sandbox")
    kinds = frozenset({"python", "docker"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        held = on_side(verified_problems(inputs), p.heldout, True)
        problems = first_of_each_domain(held, p.max_problems)
        if not problems:
            raise StageInputError(
                f"grpo_eval: no verified problem of verified_outputs falls in the held-out split "
                f"(heldout.fraction={p.heldout.fraction}, salt {p.heldout.salt!r}): verify more "
                f"problems or raise heldout.fraction in pipeline.yaml"
            )
        models = CheckpointModels(self, ctx, checkpoint_path(inputs, "grpo_roc_checkpoint"), None)
        system, user = self.prompts["agent_system"], self.prompts["agent_user"]
        rows = []
        for method, turns in METHODS.items():
            config = p.rollout.model_copy(update={"max_turns": turns or p.rollout.max_turns})

            def key(q: VerifiedProblem, config=config) -> str:
                return fingerprint(
                    models.policy_name,
                    config.model_dump(mode="json"),
                    agent_prompt(system, user, q.question, q.domain),
                    [q.answer, q.inputs, q.labels],  # they grade the outcome, never generation
                )

            def compute(
                todo: list[VerifiedProblem], done: Callable[[int, dict], None], config=config
            ) -> None:
                llm, sandbox = models.policy(), ctx.resource("sandbox").get()
                prompts = [agent_prompt(system, user, q.question, q.domain) for q in todo]

                def finished(j: int, group: list[Trajectory], seconds: float) -> None:
                    # Graded at once (a sandbox run for a code problem), then committed.
                    q, [trajectory] = todo[j], group
                    [[reward]] = rewards([group], [agent_problem(q)], sandbox, config.timeout_s)
                    calls = trajectory.tool_calls
                    done(
                        j,
                        {
                            "answer": (
                                final_answer(trajectory.final_text) if q.domain == "math" else None
                            ),
                            "correct": reward == 1.0,
                            "turns": sum(m["role"] == "assistant" for m in trajectory.messages),
                            "tool_calls": len(calls),
                            "tool_errors": sum(c.status != "ok" for c in calls),
                            "tokens": trajectory.completion_tokens,
                            "seconds": seconds,
                        },
                    )

                run_rollouts(llm, sandbox, prompts, 1, config, seed=0, on_done=finished)

            # Every problem at once (the LLM backend decides how much is in flight), each
            # committed as soon as its rollout has ended.
            stored = ctx.cache.map_streamed(problems, key, compute)
            rows += [
                {
                    "problem_id": q.id,
                    "seed_id": q.seed_id,
                    "batch": q.batch,
                    "round": p.round,
                    "domain": q.domain,
                    "gold_answer": q.answer,
                    "method": method,
                    **outcome,
                    "policy": models.policy_name,
                }
                for q, outcome in zip(problems, stored, strict=True)
            ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(problems),
                "policy": models.policy_name,
                "summary": _summary(rows),
            },
        )


def _summary(rows: list[dict]):
    table = []
    for method in METHODS:
        for domain in ("math", "code"):
            mine = [r for r in rows if r["method"] == method and r["domain"] == domain]
            if mine:
                n = len(mine)
                table.append(
                    [
                        method,
                        domain,
                        n,
                        f"{sum(r['correct'] for r in mine) / n:.3f}",
                        f"{sum(r['tool_calls'] for r in mine) / n:.2f}",
                        f"{sum(r['tokens'] for r in mine) / n:.0f}",
                        f"{sum(r['seconds'] for r in mine) / n:.2f}",
                    ]
                )
    return markdown_table(
        [
            "method",
            "domain",
            "problems",
            "accuracy",
            "tool calls/problem",
            "tokens/problem",
            "seconds/problem",
        ],
        table,
    )
