"""Schedules over the declared pipeline."""

from __future__ import annotations

import dagster as dg

from rstar_pipelines.pipeline.spec import PipelineSpec


def aggregates_schedule(spec: PipelineSpec) -> dg.ScheduleDefinition | None:
    """Daily refresh of the cheap unpartitioned aggregates (all seed batches together).
    Assets in a pool (generation, training) are left to their automation and to users."""
    keys = [
        key
        for asset in spec.assets
        if not asset.partitioned and asset.decl.pool is None
        for key in asset.output_keys()
    ]
    if not keys:
        return None
    return dg.ScheduleDefinition(
        name="daily_aggregates",
        cron_schedule="0 3 * * *",
        execution_timezone="UTC",
        target=dg.AssetSelection.assets(*keys),
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Re-materializes the unpartitioned aggregates once a day.",
    )
