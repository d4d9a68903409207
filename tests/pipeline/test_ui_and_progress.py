"""What a user meets in the UI and on the console, for any stage: rounded figures, column
descriptions from the data contracts, an artifact's `path`, warning checks, one line per
asset and progress every 10%."""

import io
import logging
from typing import ClassVar

import dagster as dg
import pyarrow as pa
import pytest
import yaml

from rstar_pipelines import progress, settings
from rstar_pipelines.definitions import build_definitions
from rstar_pipelines.pipeline.factory import rounded
from rstar_pipelines.pipeline.spec import load_pipeline
from rstar_pipelines.pipeline.stage import (
    CheckOutcome,
    CheckSpec,
    Stage,
    StageContext,
    StageResult,
)
from rstar_pipelines.sandbox_resource import CountingSandbox
from rstar_pipelines.stages import STAGES
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.stages import PolicyCheckpoint, PolicyTrainingParams
from rstar_sandbox import Job
from tests.fakes.sandbox import GatedSandbox


class FakeArtifact(Stage):
    """Computes 20 items through the item cache (one sandbox job each) and records a
    directory it wrote, like a checkpoint."""

    schema = schemas.CHECKPOINT
    checks: ClassVar = (CheckSpec("made_updates", "changed something", blocking=False, warn=True),)

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        def compute(batch):
            progress.count(sandbox_jobs=len(batch), completions=len(batch), tokens=10 * len(batch))
            return [x * 2 for x in batch]

        doubled = ctx.cache.map(list(range(20)), str, compute, chunk=2)
        out = settings.data_dir() / "artifact"
        out.mkdir(parents=True)
        row = {"id": "a", "job": "sft", "round": 1, "path": str(out), "steps": 2}
        return StageResult(
            table=pa.Table.from_pylist([row], schema=self.schema),
            metadata={"yield": 2 / 3, "total": sum(doubled), "curve": {"loss": [1 / 3, 0.25]}},
            checks=[CheckOutcome("made_updates", passed=False, metadata={"updates": 0})],
        )


def test_rounded_keeps_four_significant_digits_and_the_integer_part():
    assert rounded(2 / 3) == 0.6667
    assert rounded(12345.678) == 12346
    assert rounded(41.23456) == 41.23
    assert rounded(0.000123456) == 0.0001235
    assert rounded({"a": [1 / 3, 7], "b": "x"}) == {"a": [0.3333, 7], "b": "x"}
    assert rounded(0.0) == 0.0 and rounded(float("inf")) == float("inf")


def test_every_column_of_every_data_contract_has_a_description():
    contracts = {k: v for k, v in vars(schemas).items() if isinstance(v, pa.Schema)}
    assert len(contracts) >= 15
    missing = [
        f"{k}.{f.name}" for k, s in contracts.items() for f in s if not schemas.description(f)
    ]
    assert missing == []


def test_a_stage_in_dagster_shows_rounded_figures_descriptions_its_artifact_and_warnings(
    tmp_path, isolated_dirs
):
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {"version": 1, "assets": [{"key": "artifact", "stage": "FakeArtifact", "group": "t"}]}
        )
    )
    spec = load_pipeline(path, {**STAGES, "FakeArtifact": FakeArtifact}, settings.prompts_dir())
    defs = build_definitions(spec)
    shown = io.StringIO()
    with dg.instance_for_test() as instance, progress.console(shown):
        result = dg.materialize(
            list(defs.assets), instance=instance, resources=dict(defs.resources)
        )
        assert result.success  # a failed warning blocks nothing
        logged = [
            e.message
            for e in instance.all_logs(result.run_id)
            if e.level == logging.INFO and "items (" in e.message
        ]

    [event] = result.get_asset_materialization_events()
    metadata = event.materialization.metadata
    assert metadata["path"].value == str(isolated_dirs / "artifact")
    assert metadata["parquet_file"].value.endswith("artifact.parquet")
    assert metadata["yield"].value == 0.6667
    assert metadata["curve"].value == {"loss": [0.3333, 0.25]}
    columns = {c.name: c.description for c in metadata["dagster/column_schema"].value.columns}
    assert columns["path"] == "the checkpoint: a Hugging Face directory"

    [check] = result.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN

    # Progress at INFO every 10% (what the run's page shows), with rates.
    assert len(logged) == 10 and logged[4].startswith("artifact: 10/20 items (50%)")
    assert "sandbox jobs/s" in logged[0] and "tokens/s" in logged[0]
    lines = shown.getvalue().splitlines()
    assert lines[0] == "▶ artifact"
    assert lines[-1].startswith("✔ artifact: artifact 1 rows, yield 0.667")
    assert "20 completions, 200 tokens, 20 sandbox jobs" in lines[-1]
    assert sum("items (" in line for line in lines) == 10

    # Run again: every item comes from the cache, and no progress is logged for it.
    shown.truncate(0)
    with dg.instance_for_test() as instance, progress.console(shown):
        (isolated_dirs / "artifact").rmdir()
        assert dg.materialize(list(defs.assets), instance=instance, resources=dict(defs.resources))
    assert "items (" not in shown.getvalue()


def test_a_training_that_made_no_update_fails_its_warning_check(tmp_path):
    stage = PolicyCheckpoint(PolicyTrainingParams(model="policy"))
    ctx = StageContext(partition_key=None, log=logging.getLogger("t"), run_id="r")
    # As the training process writes them (module training.run), the launch it ran included.
    launch = {"processes": 1, "mixed_precision": "no"}
    metrics = {"losses": [], "steps": 2, "examples": 4, "seconds": 1.5, "launch": launch}
    [check] = stage._result(ctx, tmp_path, "embedded", metrics).checks
    assert (check.name, check.passed, check.metadata["optimizer_updates"]) == (
        "made_updates",
        False,
        0,
    )
    trained = stage._result(ctx, tmp_path, "embedded", {**metrics, "losses": [0.5, 0.4]})
    assert trained.checks[0].passed
    assert trained.metadata["mixed_precision"] == "no"  # what the job ran, `auto` resolved
    [spec] = PolicyCheckpoint.checks
    assert spec.warn and not spec.blocking
    with pytest.raises(ValueError, match="never blocks"):
        CheckSpec("x", "y", blocking=True, warn=True)


def test_the_demo_waves_are_named_jobs_of_the_code_location():
    from rstar_pipelines.definitions import defs, load_spec
    from rstar_pipelines.materialize import run_waves

    waves = run_waves(load_spec())
    assert [w.name for w in waves] == ["batch_chain", "aggregates"]
    for wave in waves:
        job = defs.resolve_job_def(wave.name)
        assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == set(
            wave.keys()
        )


def test_a_streamed_stage_reports_its_sandbox_jobs_as_they_finish():
    """A stage that advances between streamed jobs shows their rate in every line, not
    only once the stream is spent."""
    gated = GatedSandbox()
    gated.gate.set()
    sandbox = CountingSandbox(gated)
    jobs = [Job("print(1)", str(i)) for i in range(10)]
    shown = io.StringIO()
    with progress.console(shown), progress.step("streamed", None, logging.getLogger("t")) as s:
        with progress.track(len(jobs)) as task:
            for _ in sandbox.stream(jobs):
                task.advance(1)
        assert s.counts["sandbox_jobs"] == 10
    lines = [line for line in shown.getvalue().splitlines() if "items (" in line]
    assert len(lines) == 10 and all("sandbox jobs/s" in line for line in lines)
