"""Stage kinds that train: ppm_checkpoint and policy_checkpoint (attn_gate_checkpoint, in
gate_stages.py, and grpo_roc_checkpoint, in agent_stages.py, are two more).

Training runs out of the Dagster process: the launcher (`python -m
rstar_pipelines.training.launch`, through Dagster Pipes) starts `accelerate launch` with the
asset's declared `launch` block, so an out-of-memory kill fails the step, not the run, and the
same job runs on one CPU or many GPUs. The job's directory under <data>/checkpoints/<name>/ is
named by a fingerprint of everything the job reads (base model, data, train and launch
settings): materializing the asset again after a kill finds the same directory and the trainer
resumes from its last checkpoint; a finished job's directory is never written again (the next
run of the same job takes `<fingerprint>-2`, and so on). The asset is one row with the
checkpoint's path and the training figures, which the next round reads.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import itertools
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from rstar_pipelines import settings
from rstar_pipelines.llm.embedded import TRAINING_CONFIG_FILE
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
from rstar_pipelines.training import devices
from rstar_pipelines.training.config import LaunchConfig
from rstar_pipelines.training.ppm import PPMTrainConfig
from rstar_pipelines.training.run import METRICS_FILE
from rstar_pipelines.training.sft import SFTTrainConfig


class TrainingParams(StageParams):
    """What every training stage declares besides its recipe (`train`)."""

    launch: LaunchConfig = LaunchConfig()
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads per training process (default: the machine's CPUs "
        "shared among its processes; with an accelerate_config, what that config says)",
    )


class PolicyTrainingParams(TrainingParams):
    model: str  # the base model's role: the policy is retrained from it every round
    round: int = Field(1, ge=1)
    train: SFTTrainConfig = SFTTrainConfig()


class PPMTrainingParams(TrainingParams):
    round: int = Field(1, ge=1)
    train: PPMTrainConfig = PPMTrainConfig()


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
        data = _parquet_bytes(self.training_data(ctx, inputs))
        base = self.base_model(ctx, inputs)
        job = {
            "job": self.job,
            "base_model": base,
            "train": self.train_settings(ctx),
            # `auto` resolved here, on the machine that trains: the precision is in the
            # fingerprint, so a bfloat16 job is never resumed or reused as a float32 one.
            "launch": devices.resolved(p.launch, self.job).model_dump(mode="json"),
            "num_threads": p.num_threads,
        }
        root = settings.data_dir() / "checkpoints" / self.checkpoint_name()
        with job_directory(root, fingerprint(job, data)) as out:
            (out / "train_data.parquet").write_bytes(data)
            config = {**job, "data": str(out / "train_data.parquet"), "output_dir": str(out)}
            config_file = out / TRAINING_CONFIG_FILE
            config_file.write_text(json.dumps(config, indent=2))
            ctx.run_process(
                [sys.executable, "-m", "rstar_pipelines.training.launch", str(config_file)]
            )
            metrics = json.loads((out / METRICS_FILE).read_text())
        return self._result(ctx, out, base, metrics)

    def _result(self, ctx: StageContext, out: Path, base: str, m: dict[str, Any]) -> StageResult:
        row = {"id": out.name, **self._row(out, base, m), "run_id": ctx.run_id}
        shown = {k: v for k, v in row.items() if v is not None and k not in ("id", "job")}
        losses = m["losses"]
        updates = len(losses)  # one loss per optimizer step taken
        metadata = {
            **shown,
            "mixed_precision": m["launch"]["mixed_precision"],
            "loss_curve": line_plot(losses, f"{self.job} loss", "step", "loss"),
        }
        if m.get("heldout_accuracy_curve"):
            metadata["heldout_accuracy_curve"] = line_plot(
                m["heldout_accuracy_curve"], "held-out pairwise accuracy", "evaluation", "accuracy"
            )
        return StageResult(
            table=pa.Table.from_pylist([row], schema=self.schema),
            metadata=metadata,
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
            "processes": m.get("processes"),
            "resumed_from_step": m.get("resumed_from_step"),
        }


class PolicyCheckpoint(TrainingStage):
    """The policy fine-tuned on sft_dataset from the declared base model (docs/training.md; the
    paper retrains from the base model every round), the step tags added as tokens."""

    Params = PolicyTrainingParams
    resources = ("llm",)
    job = "sft"
    data_input = "sft_dataset"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return _local_model(ctx, self.model)


class PPMCheckpoint(TrainingStage):
    """The process preference model: this round's policy with a scalar head, trained on
    ppm_pairs with the pairwise loss weighted 1/(pos·neg) (docs/training.md)."""

    Params = PPMTrainingParams
    job = "ppm"
    data_input = "ppm_pairs"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return policy_checkpoint_path(inputs)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def fingerprint(job: dict[str, Any], data: bytes) -> str:
    """What names a job's directory: its settings and the bytes of its data."""
    digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode())
    digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()[:16]


@contextmanager
def job_directory(root: Path, name: str) -> Iterator[Path]:
    """The directory of the job named `name` under root, locked while the context is open: the
    first of `name`, `name-2`, ... that holds no finished job (no metrics file) and that no
    other run holds. A killed job's directory is found again, with its checkpoints."""
    for attempt in itertools.count(1):
        path = root / (name if attempt == 1 else f"{name}-{attempt}")
        if (path / METRICS_FILE).exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        lock = (path / ".lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run is training this very job now
            lock.close()
            continue
        try:
            yield path
        finally:
            lock.close()
        return


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
