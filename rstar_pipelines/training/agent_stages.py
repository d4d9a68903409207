"""grpo_roc_checkpoint: the round's policy trained with GRPO-RoC (rStar2-Agent, spec §6), out of
process like the other checkpoints.

The trainer reads one row per problem: its id, domain, question, gold answer (math) or verified
test inputs and labels (code), and `prompt`, the chat a rollout starts from, rendered here from
the agent_system and agent_user templates. So the training data file shows exactly what the
policy is given, and the training process renders nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.agent.format import agent_prompt
from rstar_pipelines.agent.reward import AgentProblem
from rstar_pipelines.dser.stages import verified_code_problems
from rstar_pipelines.math.search_stages import is_heldout, verified_math_problems
from rstar_pipelines.pipeline.plots import line_plot
from rstar_pipelines.pipeline.stage import (
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
)
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.grpo import GRPOTrainConfig
from rstar_pipelines.training.stages import TrainingStage, policy_checkpoint_path

# The rows a grpo job reads (training/run.py).
GRPO_DATA = pa.schema(
    [
        ("id", pa.string()),
        ("domain", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("labels", pa.list_(pa.string())),
        ("prompt", pa.list_(schemas.MESSAGE)),
    ]
)


class GRPOTrainingParams(StageParams):
    round: int = Field(1, ge=1)
    heldout_fraction: float = Field(
        0.2, ge=0, lt=1, description="problems kept for evaluation (mcts_eval's split)"
    )
    max_problems: int | None = Field(None, ge=1, description="at most this many of each domain")
    # sandbox_backend and sandbox_workers are set from the sandbox resource when the stage runs.
    train: GRPOTrainConfig = GRPOTrainConfig()
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads of the trainer")


class GRPORoCCheckpoint(TrainingStage):
    """The round's policy checkpoint trained with GRPO-RoC on the verified problems of the
    training side of the held-out split (math with a gold answer, code with verified tests),
    calling a Python tool in the sandbox during its rollouts."""

    Params = GRPOTrainingParams
    prompt_roles = ("agent_system", "agent_user")
    resources = ("sandbox",)
    job = "grpo"
    data_input = "verified_outputs"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return policy_checkpoint_path(inputs)

    def training_data(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> pa.Table:
        p = self.params
        math = [
            AgentProblem(q["id"], "math", q["question"], q["answer"])
            for q in verified_math_problems(inputs)
        ]
        code = [
            AgentProblem(**dataclasses.asdict(h.problem)) for h in verified_code_problems(inputs)
        ]
        problems: list[AgentProblem] = []
        for found in (math, code):
            problems += [q for q in found if not is_heldout(q.id, p.heldout_fraction)][
                : p.max_problems
            ]
        if not problems:
            raise StageInputError(
                "no verified problem on the training side of the held-out split: there is "
                "nothing to train the grpo on (verify more problems, or lower heldout_fraction)"
            )
        system, user = self.prompts["agent_system"], self.prompts["agent_user"]
        rows = [
            {
                **dataclasses.asdict(q),
                "prompt": agent_prompt(system, user, q.question, q.domain),
            }
            for q in problems
        ]
        return pa.Table.from_pylist(rows, schema=GRPO_DATA)

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
