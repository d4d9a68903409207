"""Stage kinds of the SeerAttention-R gates: gate_distill_data (the texts) and
attn_gate_checkpoint (gates distilled from the frozen policy model, out of process)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from rstar_pipelines import settings
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.gate import GateTrainSettings
from rstar_pipelines.training.stages import TrainingStage, _local_model


class GateDataParams(StageParams):
    seed_solutions: bool = Field(
        True,
        description="also each code seed with its first oracle solution (verified by "
        "definition), so a batch whose candidates all failed still has texts",
    )
    text_file: str | None = Field(
        None,
        description="JSONL or Parquet of more texts (`text`, optional `id`); relative paths "
        "are under the data directory",
    )
    max_texts: int | None = Field(None, ge=1)


class GateDistillData(Stage):
    """Texts to distil the attention gates on: each verified solution as a chat (problem, then
    the solution; the trainer renders it with the base model's chat template), plus the
    declared extra sources."""

    Params = GateDataParams
    schema = schemas.GATE_DISTILL_DATA

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        rows = [
            _chat_row(r["id"], "verified_solutions", r["problem_id"], r["domain"], r["messages"])
            for r in rows_of(inputs["verified_solutions"])
        ]
        if p.seed_solutions and "seed_problems" in inputs:
            rows += [
                _seed_row(r) for r in rows_of(inputs["seed_problems"]) if r["oracle_solutions"]
            ]
        if p.text_file is not None:
            rows += _file_rows(settings.resolve_data_path(p.text_file))
        rows = rows[: p.max_texts]
        counts = Counter(r["source"] for r in rows)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={"texts": len(rows), **{f"from_{k}": v for k, v in sorted(counts.items())}},
        )


def _chat_row(
    id_: str, source: str, problem_id: str, domain: str, messages: list[dict]
) -> dict[str, Any]:
    return {
        "id": id_,
        "source": source,
        "problem_id": problem_id,
        "domain": domain,
        "text": None,
        "messages": messages,
    }


def _seed_row(seed: dict[str, Any]) -> dict[str, Any]:
    solution = seed["oracle_solutions"][0].rstrip("\n")
    messages = [
        {"role": "user", "content": seed["problem"]},
        {"role": "assistant", "content": f"```python\n{solution}\n```"},
    ]
    return _chat_row(f"{seed['id']}:oracle", "seed_problems", seed["id"], seed["domain"], messages)


def _file_rows(path: Path) -> list[dict[str, Any]]:
    """The texts of a JSONL or Parquet file, each with its `id` or `<file>:<line>`."""
    if not path.is_file():
        raise StageInputError(f"text_file not found: {path}")
    if path.suffix == ".parquet":
        try:
            records = pq.read_table(path).to_pylist()
        except pa.ArrowInvalid as error:
            raise StageInputError(f"{path} is not a Parquet file: {error}") from error
    else:
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line) if line.strip() else None)
            except json.JSONDecodeError as error:
                raise StageInputError(f"{path} line {number} is not JSON: {error}") from error
    rows = []
    for number, record in enumerate(records, 1):
        if record is None:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise StageInputError(f"{path} row {number} has no string `text`")
        rows.append(
            {
                "id": str(record.get("id") or f"{path.name}:{number}"),
                "source": "file",
                "problem_id": None,
                "domain": None,
                "text": record["text"],
                "messages": None,
            }
        )
    return rows


class GateTrainingParams(StageParams):
    model: str  # the frozen base model's role
    train: GateTrainSettings = GateTrainSettings()
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads of the trainer")


class AttnGateCheckpoint(TrainingStage):
    """SeerAttention-R gates for the declared base model, self-distilled from its own attention
    on gate_distill_data (spec §1.4-1.5); the base model stays frozen. The row reports the
    held-out top-k block recall before (fresh gates) and after training."""

    Params = GateTrainingParams
    schema = schemas.GATE_CHECKPOINT
    resources = ("llm",)
    job = "gate"
    data_input = "gate_distill_data"
    empty_hint = "verify some solutions, keep seed_solutions on, or declare a text_file"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return _local_model(ctx, self.model)

    def checkpoint_name(self) -> str:
        return "attn_gates"

    def _row(self, out: Path, base: str, m: dict[str, Any]) -> dict[str, Any]:
        gate = m["gate_config"]
        return {
            "path": str(out),
            "base_model": base,
            "examples": m["examples"],
            "heldout_examples": m["heldout_examples"],
            "steps": m["steps"],
            "final_loss": m["losses"][-1],
            "block_size": gate["block_size"],
            "gate_dim": gate["gate_dim"],
            "topk_blocks": m["topk_blocks"],
            "heldout_recall_before": m["heldout_recall_before"],
            "heldout_recall_after": m["heldout_recall_after"],
            "seconds": m["seconds"],
        }
