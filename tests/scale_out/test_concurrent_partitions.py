"""Two partitions materialized at once by two processes (each run's steps in its own
process: what is shared is between the runs): their item caches never share a
file (one SQLite file per asset partition) or share Postgres, so no "database is
locked" and no lost cache entries."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

from tests.fakes.coder import write_seeds
from tests.fakes.coder_location import materialize
from tests.fakes.servers import new_database

ASSETS = ["seed_problems", "seed_rejects", "synthesized_problems", "candidate_solutions"]
CACHED = ("synthesized_problems", "candidate_solutions")


def cache_misses(instance: dg.DagsterInstance, batch: str) -> dict[str, int]:
    out = {}
    for key in CACHED:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[batch]), limit=1
        ).records
        out[key] = records[0].asset_materialization.metadata["cache_misses"].value
    return out


def both_at_once(env: dict, batches: list[str]) -> None:
    procs = [materialize(env, ASSETS, batch, in_process=True) for batch in batches]
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-5000:]
        assert "database is locked" not in log


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_two_partitions_at_once(store, request, isolated_dirs, incoming, tmp_path):
    env = {**os.environ}
    if store == "postgres":
        env["RSTAR_ITEM_CACHE_URL"] = new_database(request.getfixturevalue("postgres_url"))
    batches = ["p1", "p2"]
    for batch in batches:
        write_seeds(incoming, batch)
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("seed_batches", batches)

    both_at_once(env, batches)
    if store == "sqlite":
        for key in CACHED:
            assert sorted(p.name for p in (isolated_dirs / "cache" / key).iterdir()) == [
                "p1.sqlite",
                "p2.sqlite",
            ]
    with dg.DagsterInstance.get() as instance:
        first = {batch: cache_misses(instance, batch) for batch in batches}
    # Real work was done (with Postgres the second partition may reuse the first's items).
    assert all(sum(first[b][key] for b in batches) > 0 for key in CACHED)

    # Again: every item of both partitions was kept.
    both_at_once(env, batches)
    with dg.DagsterInstance.get() as instance:
        assert {batch: cache_misses(instance, batch) for batch in batches} == {
            batch: dict.fromkeys(CACHED, 0) for batch in batches
        }


def test_cache_location_per_partition_or_postgres(monkeypatch, isolated_dirs):
    from rstar_pipelines.pipeline.cache_store import cache_location

    assert cache_location("a", "b/1") == Path(isolated_dirs / "cache" / "a" / "b%2F1.sqlite")
    assert cache_location("agg", None) == isolated_dirs / "cache" / "agg.sqlite"
    monkeypatch.setenv("RSTAR_DEPLOYMENT", "hosts")
    monkeypatch.setenv("RSTAR_POSTGRES_URL", "postgresql+psycopg2://u@h:5432/d")
    assert cache_location("a", "b") == "postgresql+psycopg2://u@h:5432/d#a"
    monkeypatch.setenv("RSTAR_ITEM_CACHE_URL", "sqlite:///x")
    with pytest.raises(ValueError, match="postgresql://"):
        cache_location("a", "b")
