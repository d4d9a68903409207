"""Schedules over the declared pipeline."""

from __future__ import annotations

import dagster as dg

from rstar_pipelines.pipeline.spec import DeclaredAsset, PipelineSpec


def behind_upstream(instance: dg.DagsterInstance, assets: list[DeclaredAsset]) -> list[str]:
    """The assets (their keys) that an upstream asset has materialized after, or that were
    never materialized while an upstream one was: the ones a refresh would change."""
    keys = {a.key for a in assets} | {u for a in assets for u in a.decl.upstream}
    latest = instance.get_latest_materialization_events([dg.AssetKey(k) for k in keys])

    def when(key: str) -> float | None:
        event = latest.get(dg.AssetKey(key))
        return event.timestamp if event is not None else None

    behind = []
    for asset in assets:
        upstream = [t for t in map(when, asset.decl.upstream) if t is not None]
        mine = when(asset.key)
        if upstream and (mine is None or max(upstream) > mine):
            behind.append(asset.key)
    return behind


def aggregates_schedule(spec: PipelineSpec) -> dg.ScheduleDefinition | None:
    """Daily refresh of the cheap unpartitioned aggregates (all seed batches together) that
    are behind their upstream; one that is up to date is not run again. Assets in a pool
    (generation, training) are left to their automation and to users."""
    assets = [a for a in spec.assets if not a.partitioned and a.decl.pool is None]
    keys = [key for asset in assets for key in asset.output_keys()]
    if not keys:
        return None

    @dg.schedule(
        name="daily_aggregates",
        cron_schedule="0 3 * * *",
        execution_timezone="UTC",
        target=dg.AssetSelection.assets(*keys),
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Once a day, re-materializes the unpartitioned aggregates that are "
        "behind their upstream assets.",
    )
    def _schedule(context: dg.ScheduleEvaluationContext):
        behind = behind_upstream(context.instance, assets)
        if not behind:
            return dg.SkipReason("every aggregate is newer than its upstream assets")
        selected = [k for a in assets if a.key in behind for k in a.output_keys()]
        return dg.RunRequest(asset_selection=[dg.AssetKey(k) for k in selected])

    return _schedule
