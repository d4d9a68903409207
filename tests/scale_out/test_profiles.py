"""The deployment profiles: what each sets, the Postgres instance's pool limits (freed
after a run ends or is cancelled), the lake on another fsspec filesystem, and the k8s
profile's rendered Job specs against a snapshot (no cluster runs here)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import types

import dagster as dg
import pyarrow as pa
import pytest
from dagster._daemon.monitoring.concurrency import execute_concurrency_slots_iteration

from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.deployment.instance import init_instance, pool_limits
from rstar_pipelines.deployment.k8s import render_jobs
from rstar_pipelines.storage import ParquetIOManager, query, read_table, write_table
from tests.fakes.repo import REPO
from tests.fakes.servers import new_database

SNAPSHOT = REPO / "tests" / "snapshots" / "k8s_jobs.json"


@pytest.mark.parametrize(
    ("profile", "executor"), [("local", "multi_or_in_process_executor"), ("hosts", "celery"),
                              ("k8s", "k8s")]
)  # fmt: skip
def test_one_setting_chooses_the_executor(profile, executor, monkeypatch):
    monkeypatch.setenv("RSTAR_DEPLOYMENT", profile)
    defs = build_definitions(load_spec())
    job = defs.resolve_implicit_global_asset_job_def()
    assert job.executor_def.name == executor
    tags = {n.name: n.definition.tags for n in job.graph.node_dict.values()}
    assert tags["test_inputs"]["dagster-celery/queue"] == "sandbox"
    assert tags["policy_checkpoint"]["dagster-celery/queue"] == "gpu"
    assert "dagster-celery/queue" not in tags["verified_solutions"]


def test_unknown_profile_and_pool_are_named(monkeypatch):
    monkeypatch.setenv("RSTAR_DEPLOYMENT", "cloud")
    with pytest.raises(ValueError, match="RSTAR_DEPLOYMENT='cloud'"):
        build_definitions(load_spec())
    with pytest.raises(ValueError, match="no such pool"):
        pool_limits(load_spec().pools(), {"gpus": 2})


def test_pool_slots_are_freed_after_a_cancelled_run(postgres_url, tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR_POSTGRES_URL", new_database(postgres_url))
    home = tmp_path / "home"
    assert init_instance(home, "hosts", load_spec().pools(), {"gpu": 1}) == {
        "gpu": 1,
        "llm": 4,
        "sandbox": 4,
    }
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] == 30
        run = instance.create_run_for_job(dg.GraphDefinition("noop").to_job())
        storage = instance.event_log_storage
        assert storage.claim_concurrency_slot("gpu", run.run_id, "policy_checkpoint").is_claimed
        # A second step waits: the limit holds for every run on every host.
        assert not storage.claim_concurrency_slot("gpu", "other-run", "ppm_checkpoint").is_claimed
        instance.report_run_canceled(run)
        assert storage.get_concurrency_info("gpu").active_run_ids == {run.run_id}
        # The daemon's slot check, once the run has been over for longer than the setting.
        later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=120)
        monkeypatch.setattr(
            "dagster._daemon.monitoring.concurrency.get_current_datetime", lambda: later
        )
        context = types.SimpleNamespace(instance=instance)
        list(execute_concurrency_slots_iteration(context, logging.getLogger("test")))
        info = storage.get_concurrency_info("gpu")
        assert info.slot_count == 1 and info.active_run_ids == set()


def test_the_lake_on_another_filesystem(monkeypatch):
    """memory:// stands for any fsspec URL (s3://, gs://, ...): written and read through
    the IO manager, queried by DuckDB through the same filesystem."""
    monkeypatch.setenv("RSTAR_LAKE_URL", "memory://rstar-lake")

    @dg.asset(partitions_def=dg.StaticPartitionsDefinition(["b1", "b2"]))
    def rows(context) -> pa.Table:
        return pa.table({"batch": [context.partition_key], "n": [len(context.partition_key)]})

    @dg.asset
    def total(rows: dict) -> pa.Table:
        return pa.table({"n": [sum(t["n"][0].as_py() for t in rows.values())]})

    resources = {"io_manager": ParquetIOManager()}
    for batch in ("b1", "b2"):
        assert dg.materialize([rows], partition_key=batch, resources=resources).success
    assert dg.materialize([rows, total], selection=["total"], resources=resources).success
    assert read_table("memory://rstar-lake/total.parquet").to_pylist() == [{"n": 4}]
    assert query("select batch from rows order by batch").to_pylist() == [
        {"batch": "b1"},
        {"batch": "b2"},
    ]
    write_table(pa.table({"x": [1]}), "memory://rstar-lake/total.parquet")  # an overwrite
    assert read_table("memory://rstar-lake/total.parquet").to_pylist() == [{"x": 1}]


def test_k8s_job_specs_match_snapshot():
    """The Jobs and the training pod the k8s profile creates, rendered by dagster-k8s;
    regenerate with RSTAR_UPDATE_SNAPSHOTS=1 when a change is meant."""
    rendered = render_jobs(
        load_spec().pools(), image="registry.example/rstar-pipelines:1", namespace="rstar"
    )
    if os.environ.get("RSTAR_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(SNAPSHOT.read_text())
    gpu = rendered["training_pod"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["tolerations"][0]["key"] == "nvidia.com/gpu"
    for pool in ("default", "llm", "sandbox", "gpu"):
        container = rendered[f"step:{pool}"]["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
