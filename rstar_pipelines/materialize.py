"""Materializing the whole declared graph for one seed batch, in dependency order.

A Dagster run takes one partition key for all of its assets, so the graph is run as
a sequence of runs: consecutive assets (in topological order) that share a
partitioning go in one run, partitioned ones for the given batch.
"""

from __future__ import annotations

from graphlib import TopologicalSorter

import dagster as dg

from rstar_pipelines.pipeline.spec import DeclaredAsset, PipelineSpec


def run_waves(spec: PipelineSpec) -> list[list[DeclaredAsset]]:
    graph = {a.key: {spec.producer_of(u).key for u in a.decl.upstream} for a in spec.assets}
    order = [spec.by_key[k] for k in TopologicalSorter(graph).static_order()]
    waves: list[list[DeclaredAsset]] = []
    for asset in order:
        if waves and waves[-1][0].partitioned == asset.partitioned:
            waves[-1].append(asset)
        else:
            waves.append([asset])
    return waves


def materialize_graph(
    defs: dg.Definitions, spec: PipelineSpec, partition_key: str, instance: dg.DagsterInstance
) -> list[dg.ExecuteInProcessResult]:
    """Run every declared asset: partitioned ones for `partition_key`. Stops at the first
    failed run and returns the results so far."""
    results = []
    for wave in run_waves(spec):
        keys = [key for asset in wave for key in asset.output_keys()]
        result = dg.materialize(
            list(defs.assets),
            selection=keys,
            partition_key=partition_key if wave[0].partitioned else None,
            instance=instance,
            resources=dict(defs.resources),
            raise_on_error=False,
        )
        results.append(result)
        if not result.success:
            break
    return results
