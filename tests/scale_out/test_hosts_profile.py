"""The `hosts` profile for real: a Postgres instance, a Redis broker and two Celery
workers (`rstar worker`) on loopback run the verification chain of a scripted-model
batch; a second batch's run goes on at the same time. Steps land on the queues of their
pools, the `sandbox` pool's limit of 1 holds across both workers, and the outputs equal
those of a `local` run."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import dagster as dg
import pytest

from rstar_pipelines.deployment.instance import init_instance
from rstar_pipelines.storage import read_table
from tests.fakes.coder import CHAIN, scripted_spec, write_seeds
from tests.fakes.coder_location import materialize, scripted_definitions
from tests.fakes.servers import celery_worker, new_database, stop

BATCHES = ("t1", "t2")
POOLS = scripted_spec().pools()


def hosts_env(tmp_path: Path, postgres: str, broker: str) -> dict[str, str]:
    return {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "RSTAR_DATA_DIR": str(tmp_path / "shared"),  # "NFS": the one directory every host sees
        "RSTAR_DEPLOYMENT": "hosts",
        "RSTAR_POSTGRES_URL": postgres,
        "RSTAR_CELERY_BROKER": broker,
    }


def events_of(instance: dg.DagsterInstance, run_id: str):
    return [e for e in instance.all_logs(run_id) if e.dagster_event is not None]


def step_intervals(instance, run_id) -> dict[str, tuple[float, float]]:
    starts, ends = {}, {}
    for e in events_of(instance, run_id):
        kind = e.dagster_event.event_type
        if kind == dg.DagsterEventType.STEP_START:
            starts[e.step_key] = e.timestamp
        elif kind in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
            ends[e.step_key] = e.timestamp
    return {k: (starts[k], ends[k]) for k in starts}


MEASURED = {"wall_s", "cpu_s", "peak_memory_mb"}  # what a run measures, not what it decides


def _decided(value):
    if isinstance(value, dict):
        return {k: _decided(v) for k, v in value.items() if k not in MEASURED}
    if isinstance(value, list):
        return [_decided(v) for v in value]
    return value


def lake_tables(data: Path, batch: str) -> dict[str, list[dict]]:
    """The chain's rows of one batch, without the run's own timings."""
    out = {}
    for key in CHAIN:
        rows = _decided(read_table(data / "lake" / key / f"{batch}.parquet").to_pylist())
        out[key] = sorted(rows, key=lambda r: str(sorted(r.items())))
    return out


def local_reference(tmp_path: Path, monkeypatch) -> dict[str, list[dict]]:
    """The same batch with the `local` profile, in this process."""
    data = tmp_path / "local"
    monkeypatch.setenv("RSTAR_DATA_DIR", str(data))
    monkeypatch.delenv("RSTAR_DEPLOYMENT", raising=False)
    (data / "seeds" / "incoming").mkdir(parents=True)
    write_seeds(data / "seeds" / "incoming", "t1")
    defs = scripted_definitions()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["t1"])
        result = dg.materialize(
            list(defs.assets),
            selection=CHAIN,
            partition_key="t1",
            instance=instance,
            resources=defs.resources,
        )
        assert result.success
    return lake_tables(data, "t1")


@pytest.mark.slow
def test_chain_runs_across_two_celery_workers(tmp_path, monkeypatch, postgres_url, redis_url):
    env = hosts_env(tmp_path, new_database(postgres_url), redis_url)
    monkeypatch.setenv("RSTAR_POSTGRES_URL", env["RSTAR_POSTGRES_URL"])
    home, shared = Path(env["DAGSTER_HOME"]), Path(env["RSTAR_DATA_DIR"])
    limits = init_instance(home, "hosts", POOLS, {"sandbox": 1, "llm": 2})
    assert limits == {"gpu": 1, "llm": 2, "sandbox": 1}
    (shared / "seeds" / "incoming").mkdir(parents=True)
    for batch in BATCHES:
        write_seeds(shared / "seeds" / "incoming", batch)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("seed_batches", list(BATCHES))

    # A "GPU host" serving the model's queue, a "CPU host" serving the steps in no pool;
    # both serve the sandbox queue, so only the pool's limit keeps them from overlapping.
    workers = {
        "gpuhost": celery_worker(env, "gpuhost", "llm,gpu,sandbox", tmp_path / "gpuhost.log"),
        "cpuhost": celery_worker(env, "cpuhost", "sandbox,dagster", tmp_path / "cpuhost.log"),
    }
    try:
        runs = {batch: materialize(env, CHAIN, batch) for batch in BATCHES}
        outputs = {batch: proc.communicate(timeout=900)[0] for batch, proc in runs.items()}
    finally:
        for proc in workers.values():
            stop(proc)
    for batch, proc in runs.items():
        assert proc.returncode == 0, outputs[batch][-5000:]

    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.get_run_records()
        assert len(records) == 2 and all(r.dagster_run.is_success for r in records)
        worker_of, sandbox_steps = {}, []
        for record in records:
            run_id = record.dagster_run.run_id
            for e in events_of(instance, run_id):
                if e.dagster_event.event_type != dg.DagsterEventType.ENGINE_EVENT:
                    continue
                message = e.dagster_event.message or ""
                if message.startswith("Submitting celery task"):
                    queue = message.rsplit('"', 2)[-2]
                    assert queue == (POOLS[e.step_key] or "dagster"), message
                metadata = e.dagster_event.engine_event_data.metadata
                if "Celery worker" in metadata:
                    worker_of[(run_id, e.step_key)] = metadata["Celery worker"].value
            for step, interval in step_intervals(instance, run_id).items():
                if POOLS[step] == "sandbox":
                    sandbox_steps.append((interval, run_id, step))
        assert len(worker_of) == 2 * len(set(POOLS) & set(CHAIN))  # every step, both runs
        for (_, step), host in worker_of.items():
            if POOLS[step] == "llm":
                assert host.startswith("gpuhost@"), (step, host)
            elif POOLS[step] is None:
                assert host.startswith("cpuhost@"), (step, host)
        # The sandbox pool's limit of 1 held across both workers and both runs.
        intervals = sorted(interval for interval, _, _ in sandbox_steps)
        assert len(intervals) == 4
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert start >= end, sandbox_steps
        # ... while the two runs were in progress at the same time.
        assert max(r.start_time for r in records) < min(r.end_time for r in records)
        # Every slot was given back.
        info = instance.event_log_storage.get_concurrency_info("sandbox")
        assert info.slot_count == 1 and info.active_slot_count == 0

    assert lake_tables(shared, "t1") == local_reference(tmp_path, monkeypatch)
