"""Stage kinds for seed ingestion and the cross-batch seed catalog."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pyarrow as pa
from pydantic import Field

from rstar_pipelines import settings
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageParams, StageResult
from rstar_pipelines.seeds.parse import (
    MAX_PROBLEM_CHARS,
    file_sha256,
    find_seed_file,
    parse_seed_file,
)
from rstar_pipelines.storage import schemas


class SeedIngestionParams(StageParams):
    # Relative paths are under the data directory (RSTAR_DATA_DIR, default ./data).
    incoming_dir: str = "seeds/incoming"
    max_problem_chars: int = Field(
        MAX_PROBLEM_CHARS, ge=1, description="longer problems are rejected, with their length"
    )


class SeedIngestion(Stage):
    """Validate one seed batch file into problem rows; bad rows go to the rejects table."""

    Params = SeedIngestionParams
    schema = schemas.SEED_PROBLEMS
    secondary_outputs: ClassVar[dict[str, pa.Schema]] = {"rejects": schemas.SEED_REJECTS}
    kinds = frozenset({"python", "parquet"})

    def incoming_dir(self):
        return settings.resolve_data_path(self.params.incoming_dir)

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        path = find_seed_file(self.incoming_dir(), ctx.partition_key)
        parsed = parse_seed_file(path, ctx.partition_key, self.params.max_problem_chars)
        for warning in parsed.warnings:
            ctx.log.warning("batch %s: %s", ctx.partition_key, warning)
        domains = Counter(p["domain"] for p in parsed.problems)
        ctx.log.info(
            "batch %s: %d problems kept, %d rows rejected (%s)",
            ctx.partition_key,
            len(parsed.problems),
            len(parsed.rejects),
            path,
        )
        for rej in parsed.rejects[:20]:
            ctx.log.warning(
                "rejected line %s, field %s: %s", rej["line"], rej["field"], rej["reason"]
            )
        return StageResult(
            table=pa.Table.from_pylist(parsed.problems, schema=self.schema),
            secondary={
                "rejects": pa.Table.from_pylist(parsed.rejects, schema=schemas.SEED_REJECTS)
            },
            metadata={
                "source_file": str(path),
                "source_sha256": file_sha256(path),
                "kept_rows": len(parsed.problems),
                "rejected_rows": len(parsed.rejects),
                "math_problems": domains.get("math", 0),
                "code_problems": domains.get("code", 0),
                **({"warnings": parsed.warnings} if parsed.warnings else {}),
            },
        )


class SeedCatalog(Stage):
    """One row per seed batch: how many problems of each domain it holds, and its rejects."""

    schema = schemas.SEED_CATALOG

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        problems = inputs["seed_problems"].select(["batch", "domain", "examples"]).to_pylist()
        by_domain = Counter((p["batch"], p["domain"]) for p in problems)
        with_examples = Counter(
            p["batch"] for p in problems if p["domain"] == "code" and p["examples"]
        )
        rejected = Counter(inputs["seed_rejects"].column("batch").to_pylist())
        batches = sorted({p["batch"] for p in problems} | set(rejected))
        rows = [
            {
                "batch": batch,
                "math_problems": by_domain[(batch, "math")],
                "code_problems": by_domain[(batch, "code")],
                "code_with_examples": with_examples[batch],
                "rejected_rows": rejected[batch],
            }
            for batch in batches
        ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={"batches": len(rows), "problems": len(problems)},
        )
