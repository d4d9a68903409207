import json
import logging
import shutil

import dagster as dg

from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.storage import query, read_table
from tests.fakes.repo import DEMO_SEEDS, dagster_cli, materialize_seeds


def _metadata_by_asset(result) -> dict:
    return {
        e.asset_key.to_user_string(): e.materialization.metadata
        for e in result.get_asset_materialization_events()
    }


def test_demo_batch_through_dagster_api(incoming, isolated_dirs):
    shutil.copyfile(DEMO_SEEDS, incoming / "demo.jsonl")
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["demo"])
        result = materialize_seeds(defs, instance, "demo")
        assert result.success
        events = _metadata_by_asset(result)
        problems = events["seed_problems"]
        assert problems["dagster/row_count"].value == problems["kept_rows"].value > 30
        assert problems["rejected_rows"].value == 0
        assert events["seed_rejects"]["dagster/row_count"].value == 0
        # The empty rejects table was still written, typed.
        assert read_table(isolated_dirs / "lake" / "seed_rejects" / "demo.parquet").num_rows == 0
        code_version = instance.get_latest_materialization_event(
            dg.AssetKey("seed_problems")
        ).asset_materialization.tags["dagster/code_version"]
        assert code_version == load_spec().by_key["seed_problems"].code_version

    rows = query("select domain, count(*) as n from seed_problems group by 1").to_pylist()
    counts = {row["domain"]: row["n"] for row in rows}
    assert counts["math"] >= 24 and counts["code"] >= 8


def test_malformed_batch_keeps_good_rows_and_reports_rejects(incoming):
    lines = [
        json.dumps({"problem": "What is 2+2?", "answer": "4"}),
        "{broken",
        json.dumps({"problem": "What is 3+3?"}),
        json.dumps({"domain": "code", "problem": "Print 1.", "oracle_solutions": [1]}),
    ]
    (incoming / "messy.jsonl").write_text("\n".join(lines) + "\n")
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["messy"])
        result = materialize_seeds(defs, instance, "messy")
        assert result.success
        md = _metadata_by_asset(result)
        assert md["seed_problems"]["kept_rows"].value == 1
        assert md["seed_problems"]["rejected_rows"].value == 3
    rejects = query("select line, field, reason from seed_rejects order by line").to_pylist()
    assert [(r["line"], r["field"]) for r in rejects] == [
        (2, None),
        (3, "answer"),
        (4, "oracle_solutions.0"),
    ]


def test_missing_seed_file_fails_with_a_clear_error(incoming):
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["ghost"])
        result = dg.materialize(
            list(defs.assets),
            selection=["seed_problems", "seed_rejects"],
            partition_key="ghost",
            instance=instance,
            resources=dict(defs.resources),
            raise_on_error=False,
        )
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "no seed file for batch 'ghost'" in failure.event_specific_data.error.message


def test_dagster_cli_materializes_the_demo_partition(incoming, isolated_dirs):
    shutil.copyfile(DEMO_SEEDS, incoming / "demo.jsonl")
    with dg.DagsterInstance.get() as instance:  # the instance at $DAGSTER_HOME
        instance.add_dynamic_partitions("seed_batches", ["demo"])
    # The exact command from the README.
    proc = dagster_cli(
        *("asset", "materialize", "--select", "seed_problems", "--partition", "demo"),
        *("-m", "rstar_pipelines.definitions"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RUN_SUCCESS" in proc.stderr
    assert read_table(isolated_dirs / "lake" / "seed_problems" / "demo.parquet").num_rows > 30


def test_an_empty_seed_file_is_ingested_with_a_warning(incoming):
    (incoming / "empty.jsonl").write_text("")
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["empty"])
        result = materialize_seeds(defs, instance, "empty")
        assert result.success
        warnings = [
            e.message
            for e in instance.all_logs(result.run_id)
            if e.level == logging.WARNING and "empty.jsonl is empty" in e.message
        ]
    metadata = _metadata_by_asset(result)["seed_problems"]
    assert metadata["kept_rows"].value == 0 and metadata["dagster/row_count"].value == 0
    assert metadata["warnings"].value == ["empty.jsonl is empty: the batch has no problems"]
    assert len(warnings) == 1
