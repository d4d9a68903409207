"""The Dagster code location: assets built from assets/pipeline.yaml, plus the
sensors, schedule and resources that run them."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from rstar_pipelines import deployment, settings
from rstar_pipelines.llm.resource import LLMResource
from rstar_pipelines.materialize import graph_jobs
from rstar_pipelines.pipeline.factory import build_assets
from rstar_pipelines.pipeline.spec import PipelineSpec, load_pipeline
from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_pipelines.schedules import aggregates_schedule
from rstar_pipelines.seeds.stages import SeedIngestion
from rstar_pipelines.sensors import automation_sensor, seed_file_sensor
from rstar_pipelines.stages import STAGES
from rstar_pipelines.storage import ParquetIOManager


def load_spec(path: Path | None = None) -> PipelineSpec:
    return load_pipeline(path or settings.pipeline_file(), STAGES, settings.prompts_dir())


def build_definitions(spec: PipelineSpec) -> dg.Definitions:
    schedule = aggregates_schedule(spec)
    return dg.Definitions(
        assets=build_assets(spec),
        jobs=graph_jobs(spec),
        sensors=[
            *(seed_file_sensor(a) for a in spec.with_stage(SeedIngestion)),
            automation_sensor(),
        ],
        schedules=[schedule] if schedule else [],
        resources={
            "io_manager": ParquetIOManager(),
            "llm": LLMResource(),
            "sandbox": SandboxResource(),
        },
        # RSTAR_DEPLOYMENT: local (Dagster's default), hosts (Celery), k8s.
        executor=deployment.executor(spec.pools()),
    )


defs = build_definitions(load_spec())
