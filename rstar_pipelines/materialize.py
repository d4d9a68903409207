"""Materializing the whole declared graph for one seed batch, in dependency order.

A Dagster run takes one partition key for all of its assets, so the graph is run as a
short sequence of runs ("waves"): each wave holds the assets of one partitioning whose
upstream is done by then, partitioned ones for the given batch. Each wave is a named
job of the code location (`batch_chain`, `aggregates`, ...), so the demo's runs carry
a name in the UI and a user can launch the same thing from there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from graphlib import TopologicalSorter
from pathlib import Path

import dagster as dg

from rstar_pipelines.pipeline.spec import DeclaredAsset, PipelineSpec


@dataclass(frozen=True)
class Wave:
    name: str
    partitioned: bool
    assets: tuple[DeclaredAsset, ...]

    def __iter__(self):
        return iter(self.assets)

    def keys(self) -> list[str]:
        return [key for asset in self.assets for key in asset.output_keys()]


def run_waves(spec: PipelineSpec) -> list[Wave]:
    """The fewest runs that respect the lineage: an asset joins the first wave of its
    partitioning that comes after (or is, for the same partitioning) every wave of its
    upstream assets. Waves alternate partitionings, starting with the first asset's."""
    graph = {a.key: {spec.producer_of(u).key for u in a.decl.upstream} for a in spec.assets}
    order = [spec.by_key[k] for k in TopologicalSorter(graph).static_order()]
    if not order:
        return []
    first_kind = order[0].partitioned
    wave_of: dict[str, int] = {}
    members: dict[int, list[DeclaredAsset]] = {}
    for asset in order:
        earliest = 0
        for up in graph[asset.key]:
            same = spec.by_key[up].partitioned == asset.partitioned
            earliest = max(earliest, wave_of[up] if same else wave_of[up] + 1)
        # wave k holds first_kind assets when k is even
        if (earliest % 2 == 0) != (asset.partitioned == first_kind):
            earliest += 1
        wave_of[asset.key] = earliest
        members.setdefault(earliest, []).append(asset)
    waves, seen = [], {True: 0, False: 0}
    for index in sorted(members):
        partitioned = members[index][0].partitioned
        seen[partitioned] += 1
        base = "batch_chain" if partitioned else "aggregates"
        name = base if seen[partitioned] == 1 else f"{base}_{seen[partitioned]}"
        waves.append(Wave(name, partitioned, tuple(members[index])))
    return waves


def graph_jobs(spec: PipelineSpec) -> list[dg.UnresolvedAssetJobDefinition]:
    """One job per wave of `run_waves`."""
    waves = run_waves(spec)
    return [
        dg.define_asset_job(
            wave.name,
            selection=wave.keys(),
            description=(
                "The partitioned assets of the declared graph, for one seed batch"
                if wave.partitioned
                else "The unpartitioned assets of the declared graph (all batches together)"
            )
            + f", in dependency order: run {number} of the {len(waves)} of `rstar demo`.",
        )
        for number, wave in enumerate(waves, 1)
    ]


@dg.logger(config_schema={"path": str}, description="Every event of the run, to a file.")
def event_log_file(init_context: dg.InitLoggerContext) -> logging.Logger:
    path = Path(init_context.logger_config["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"rstar.event_log.{path}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
        logger.addHandler(handler)
    return logger


def materialize_graph(
    defs: dg.Definitions,
    spec: PipelineSpec,
    partition_key: str,
    instance: dg.DagsterInstance,
    event_log: Path | None = None,
) -> list[dg.ExecuteInProcessResult]:
    """Run every declared asset, wave by wave (partitioned ones for `partition_key`), as the
    code location's jobs. With `event_log`, Dagster's events go to that file instead of
    the console. Stops at the first failed run and returns the results so far."""
    results = []
    for wave in run_waves(spec):
        job = defs.resolve_job_def(wave.name)
        run_config = {}
        if event_log is not None:
            job = job.with_logger_defs({"event_log": event_log_file})
            run_config = {"loggers": {"event_log": {"config": {"path": str(event_log)}}}}
        result = job.execute_in_process(
            run_config=run_config,
            instance=instance,
            partition_key=partition_key if wave.partitioned else None,
            raise_on_error=False,
        )
        results.append(result)
        if not result.success:
            break
    return results
