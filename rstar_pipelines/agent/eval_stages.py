"""grpo_eval: the round's GRPO-RoC policy on the held-out problems, greedy, two ways: one turn
without its tool, and with its Python tool as in its training rollouts. The gold answer (or the
verified tests) only grades the final turn."""

from __future__ import annotations

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.agent.format import agent_prompt, final_answer
from rstar_pipelines.agent.reward import AgentProblem, rewards
from rstar_pipelines.agent.rollout import RolloutConfig, Trajectory, run_rollouts
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.llm.coroutines import OPEN_MEMORY_MB
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageParams, StageResult
from rstar_pipelines.pipeline.streamed import Finished, map_problems
from rstar_pipelines.problems import VerifiedProblem, evaluated_row, heldout_problems
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
    open_rollouts_memory_mb: float = Field(
        OPEN_MEMORY_MB,
        gt=0,
        description="MiB the open rollouts may hold: problems start as the fleet has room, at "
        "most as many at once as this holds (agent.rollout.group_bytes)",
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
        problems = heldout_problems(inputs, p.heldout, p.max_problems, "grpo_eval")
        models = CheckpointModels(self, ctx, checkpoint_path(inputs, "grpo_roc_checkpoint"), None)
        rows = []
        for method, turns in METHODS.items():
            config = p.rollout.model_copy(update={"max_turns": turns or p.rollout.max_turns})
            outcomes = self._evaluate(ctx, models, problems, config)
            rows += [
                {
                    **evaluated_row(q, p.round),
                    "method": method,
                    **outcome,
                    "policy": models.policy_name,
                }
                for q, outcome in zip(problems, outcomes, strict=True)
            ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(problems),
                "policy": models.policy_name,
                "summary": _summary(rows),
            },
        )

    def _evaluate(
        self,
        ctx: StageContext,
        models: CheckpointModels,
        problems: list[VerifiedProblem],
        config: RolloutConfig,
    ) -> list[dict]:
        """Each problem's outcome of one rollout under `config`, graded by the training reward."""
        system, user = self.prompts["agent_system"], self.prompts["agent_user"]

        def key(q: VerifiedProblem) -> str:
            return fingerprint(
                models.policy_name,
                config.model_dump(mode="json"),
                agent_prompt(system, user, q.question, q.domain),
                [q.answer, q.inputs, q.labels],  # they grade the outcome, never generation
            )

        def run(todo: list[VerifiedProblem], finished: Finished) -> None:
            llm, sandbox = models.policy(), ctx.resource("sandbox").get()
            prompts = [agent_prompt(system, user, q.question, q.domain) for q in todo]

            def ended(j: int, group: list[Trajectory], seconds: float) -> None:
                # Graded at once (a sandbox run for a code problem), then committed.
                q, [trajectory] = todo[j], group
                [[reward]] = rewards([group], [agent_problem(q)], sandbox, config.timeout_s)
                finished(j, _outcome(q, trajectory, reward), seconds)

            memory_mb = self.params.open_rollouts_memory_mb
            run_rollouts(
                llm, sandbox, prompts, 1, config, seed=0, on_done=ended, memory_mb=memory_mb
            )

        return map_problems(ctx, problems, key, run, "rolled out")


def _outcome(problem: VerifiedProblem, trajectory: Trajectory, reward: float) -> dict:
    """What is kept of one problem's rollout: plain values, as cached and as the row holds them."""
    calls = trajectory.tool_calls
    return {
        "answer": final_answer(trajectory.final_text) if problem.domain == "math" else None,
        "correct": reward == 1.0,
        "turns": sum(m["role"] == "assistant" for m in trajectory.messages),
        "tool_calls": len(calls),
        "tool_errors": sum(c.status != "ok" for c in calls),
        "tokens": trajectory.completion_tokens,
    }


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
