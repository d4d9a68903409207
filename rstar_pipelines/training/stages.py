"""Stage kinds that train: ppm_checkpoint and policy_checkpoint (attn_gate_checkpoint, in
gate_stages.py, is one more).

Training runs in its own process (`python -m rstar_pipelines.training.run`, launched
through Dagster Pipes), so an out-of-memory kill fails the step, not the run. The
checkpoint is a Hugging Face directory under <data>/checkpoints/; the asset is one row
with its path and the training figures, which the next round reads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from rstar_pipelines import settings
from rstar_pipelines.pipeline.plots import line_plot
from rstar_pipelines.pipeline.stage import (
    CheckOutcome,
    CheckSpec,
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
)
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.ppm import PPMTrainConfig
from rstar_pipelines.training.run import METRICS_FILE
from rstar_pipelines.training.sft import SFTTrainConfig


class PolicyTrainingParams(StageParams):
    model: str  # the base model's role: the policy is retrained from it every round
    round: int = Field(1, ge=1)
    train: SFTTrainConfig = SFTTrainConfig()
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads of the trainer")


class PPMTrainingParams(StageParams):
    round: int = Field(1, ge=1)
    train: PPMTrainConfig = PPMTrainConfig()
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads of the trainer")


class TrainingStage(Stage):
    """Write the training data, train out of process, report the checkpoint."""

    schema = schemas.CHECKPOINT
    kinds = frozenset({"pytorch"})
    checks = (
        CheckSpec(
            "made_updates",
            "Training changed the model: at least one optimizer step was taken (every step "
            "skipped leaves the base model as it was).",
            blocking=False,
            warn=True,
        ),
    )
    job: ClassVar[str]
    data_input: ClassVar[str]
    # How to get training data when data_input is empty.
    empty_hint: ClassVar[str] = "search more problems, or with more rollouts, to get some"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        raise NotImplementedError

    def training_data(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> pa.Table:
        """The rows the trainer reads: the data_input table, which must not be empty."""
        data = inputs[self.data_input]
        if data.num_rows == 0:
            raise StageInputError(
                f"{self.data_input} is empty: there is nothing to train the {self.job} on "
                f"({self.empty_hint})"
            )
        return data

    def train_settings(self, ctx: StageContext) -> dict[str, Any]:
        """The `train` block of the trainer's config."""
        return self.params.train.model_dump(mode="json")

    def checkpoint_name(self) -> str:
        """The folder under <data>/checkpoints/ that holds one checkpoint per run."""
        return f"{self.job}-r{self.params.round}"

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        data = self.training_data(ctx, inputs)
        base = self.base_model(ctx, inputs)
        out = (
            settings.data_dir()
            / "checkpoints"
            / self.checkpoint_name()
            / (ctx.run_id or time.strftime("%Y%m%d-%H%M%S"))
        )
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, out / "train_data.parquet")
        config = {
            "job": self.job,
            "base_model": base,
            "data": str(out / "train_data.parquet"),
            "output_dir": str(out),
            "train": self.train_settings(ctx),
            "num_threads": p.num_threads,
        }
        (out / "train_config.json").write_text(json.dumps(config, indent=2))
        ctx.run_process(
            [sys.executable, "-m", "rstar_pipelines.training.run", str(out / "train_config.json")]
        )
        metrics = json.loads((out / METRICS_FILE).read_text())
        return self._result(ctx, out, base, metrics)

    def _result(self, ctx: StageContext, out: Path, base: str, m: dict[str, Any]) -> StageResult:
        row = {"id": out.name, **self._row(out, base, m), "run_id": ctx.run_id}
        shown = {k: v for k, v in row.items() if v is not None and k not in ("id", "job")}
        losses = m["losses"]
        updates = len(losses)  # one loss per optimizer step taken
        return StageResult(
            table=pa.Table.from_pylist([row], schema=self.schema),
            metadata={**shown, "loss_curve": line_plot(losses, f"{self.job} loss", "step", "loss")},
            checks=[
                CheckOutcome(
                    "made_updates",
                    passed=updates > 0,
                    metadata={"optimizer_updates": updates, "steps": m["steps"]},
                )
            ],
        )

    def _row(self, out: Path, base: str, m: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's row from the trainer's metrics (id and run_id are added)."""
        losses = m["losses"]
        return {
            "job": self.job,
            "round": self.params.round,
            "path": str(out),
            "base_model": base,
            "examples": m.get("train_pairs", m.get("examples")),
            "heldout_examples": m.get("heldout_pairs"),
            "steps": m["steps"],
            "final_loss": losses[-1] if losses else None,
            "heldout_accuracy": m.get("heldout_accuracy"),
            "train_accuracy_before": m.get("train_accuracy_before"),
            "train_accuracy_after": m.get("train_accuracy_after"),
            "seconds": m["seconds"],
        }


class PolicyCheckpoint(TrainingStage):
    """The policy fine-tuned on sft_dataset from the declared base model (spec §3; the
    paper retrains from the base model every round), the step tags added as tokens."""

    Params = PolicyTrainingParams
    resources = ("llm",)
    job = "sft"
    data_input = "sft_dataset"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return _local_model(ctx, self.model)


class PPMCheckpoint(TrainingStage):
    """The process preference model: this round's policy with a scalar head, trained on
    ppm_pairs with the pairwise loss weighted 1/(pos·neg) (spec §2)."""

    Params = PPMTrainingParams
    job = "ppm"
    data_input = "ppm_pairs"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return policy_checkpoint_path(inputs)


def policy_checkpoint_path(inputs: dict[str, pa.Table]) -> str:
    """The directory of the round's trained policy."""
    rows = inputs["policy_checkpoint"].to_pylist()
    if not rows:
        raise StageInputError("policy_checkpoint has no row: train the policy first")
    return rows[-1]["path"]


def _local_model(ctx: StageContext, model: str | None) -> str:
    name = ctx.resource("llm").model_name(model)
    if name is None:
        raise StageInputError(
            "training needs the base model's weights: declare a Hugging Face directory, a "
            ".gguf file or 'embedded' for it (the llm resource names no model)"
        )
    return name
