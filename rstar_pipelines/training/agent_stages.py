"""grpo_roc_data and grpo_roc_checkpoint: the round's policy trained with GRPO-RoC
(rStar2-Agent, docs/agent.md) on TRL, launched like the other checkpoints.

The trainer reads one row per problem of grpo_roc_data: its id, domain, question, gold answer
(math) or verified test inputs and labels (code), and `prompt`, the chat a rollout starts from,
rendered from the agent_system and agent_user templates. So the training table shows exactly what
the policy is given, the training process renders nothing, and the table's blocking check proves
it holds no held-out problem before anything trains on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.agent.format import agent_prompt
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.pipeline.plots import line_plot
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageParams, StageResult
from rstar_pipelines.problems import (
    NO_HELDOUT_CHECK,
    first_of_each_domain,
    groups_of,
    no_heldout_check,
    on_side,
    verified_problems,
)
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.grpo import GRPOTrainConfig
from rstar_pipelines.training.stages import (
    TrainingParams,
    TrainingStage,
    policy_checkpoint_path,
)


class GRPODataParams(StageParams):
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    max_problems: int | None = Field(None, ge=1, description="at most this many of each domain")


class GRPORoCData(Stage):
    """The problems GRPO-RoC trains on: the verified problems of the training side of the
    held-out split (math with a gold answer, code with verified tests), each with `prompt`, the
    chat its rollouts start from (agent_system and agent_user rendered)."""

    Params = GRPODataParams
    schema = schemas.GRPO_ROC_DATA
    prompt_roles = ("agent_system", "agent_user")
    checks = (NO_HELDOUT_CHECK,)

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        found = verified_problems(inputs)
        problems = first_of_each_domain(on_side(found, p.heldout, False), p.max_problems)
        system, user = self.prompts["agent_system"], self.prompts["agent_user"]
        rows = [
            {
                "id": q.id,
                "seed_id": q.seed_id,
                "batch": q.batch,
                "domain": q.domain,
                "question": q.question,
                "answer": q.answer,
                "inputs": list(q.inputs),
                "labels": list(q.labels),
                "prompt": agent_prompt(system, user, q.question, q.domain),
            }
            for q in problems
        ]
        groups = groups_of(inputs["problem_groups"])
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(rows),
                "math": sum(r["domain"] == "math" for r in rows),
                "code": sum(r["domain"] == "code" for r in rows),
                "heldout_problems_left_out": len(found) - len(on_side(found, p.heldout, False)),
            },
            checks=[no_heldout_check(rows, groups, p.heldout, problem_key="id")],
        )


class GRPOTrainingParams(TrainingParams):
    round: int = Field(1, ge=1)
    # sandbox_backend and sandbox_workers are set from the sandbox resource when the stage runs.
    train: GRPOTrainConfig = GRPOTrainConfig()


class GRPORoCCheckpoint(TrainingStage):
    """The round's policy checkpoint trained with GRPO-RoC on grpo_roc_data (the training side
    of the held-out split), calling a Python tool in the sandbox during its rollouts."""

    Params = GRPOTrainingParams
    resources = ("sandbox",)
    job = "grpo"
    data_input = "grpo_roc_data"
    empty_hint = "verify more problems on the training side of the held-out split"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return policy_checkpoint_path(inputs)

    def train_settings(self, ctx: StageContext) -> dict[str, Any]:
        # The training process starts its own sandbox, of the kind the resource would start.
        sandbox = ctx.resource("sandbox")
        train = self.params.train.model_copy(
            update={
                "sandbox_backend": sandbox.backend_name(),
                "sandbox_workers": sandbox.worker_count(),
            }
        )
        return train.model_dump(mode="json")

    def _row(self, out: Path, base: str, m: dict[str, Any]) -> dict[str, Any]:
        rewards = m["mean_reward"]
        return {
            **super()._row(out, base, m),
            "mean_reward_first": rewards[0],
            "mean_reward_last": rewards[-1],
        }

    def _result(self, ctx: StageContext, out: Path, base: str, m: dict[str, Any]) -> StageResult:
        result = super()._result(ctx, out, base, m)
        result.metadata.update(
            skipped_steps=m["skipped_steps"],
            reward_curve=line_plot(m["mean_reward"], "mean reward", "step", "reward"),
            tool_error_curve=line_plot(
                m["tool_error_ratio"], "tool-error ratio", "step", "failed calls / calls"
            ),
            response_length_curve=line_plot(
                m["response_length"], "response length", "step", "model tokens"
            ),
            groups_dropped_curve=line_plot(
                m["groups_dropped"], "groups dropped (equal rewards)", "step", "fraction"
            ),
        )
        return result
