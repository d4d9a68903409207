import json
import os
import shutil
import time

import dagster as dg

from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.sensors import scan_seed_files
from tests.conftest import DEMO_SEEDS


def _age(path, seconds=10):
    """Make a file look settled (written a while ago)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def _tick(sensor, instance, defs, cursor):
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
    return sensor(ctx), ctx


def test_sensor_adds_partitions_and_reruns_changed_files(incoming):
    defs = build_definitions(load_spec())
    sensor = defs.resolve_sensor_def("seed_problems_files")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    with dg.instance_for_test() as instance:
        result, _ = _tick(sensor, instance, defs, None)
        assert isinstance(result, dg.SkipReason)

        shutil.copyfile(DEMO_SEEDS, incoming / "batch_a.jsonl")
        _age(incoming / "batch_a.jsonl")
        (incoming / "notes.txt").write_text("not a seed file")
        result, _ = _tick(sensor, instance, defs, None)
        assert [r.partition_key for r in result.run_requests] == ["batch_a"]
        assert result.dynamic_partitions_requests[0].partition_keys == ["batch_a"]
        first_key = result.run_requests[0].run_key
        cursor = result.cursor
        instance.add_dynamic_partitions("seed_batches", ["batch_a"])

        # Nothing changed: skipped without hashing again.
        again, _ = _tick(sensor, instance, defs, cursor)
        assert isinstance(again, dg.SkipReason)

        # The same file changed in place runs again, under a new run key; no new partition.
        with (incoming / "batch_a.jsonl").open("a") as fh:
            fh.write(json.dumps({"problem": "What is 9-4?", "answer": "5"}) + "\n")
        _age(incoming / "batch_a.jsonl", 5)
        changed, _ = _tick(sensor, instance, defs, cursor)
        assert [r.partition_key for r in changed.run_requests] == ["batch_a"]
        assert changed.run_requests[0].run_key != first_key
        assert not changed.dynamic_partitions_requests

        # A file still being written waits for the next tick.
        shutil.copyfile(DEMO_SEEDS, incoming / "batch_b.jsonl")
        fresh, _ = _tick(sensor, instance, defs, changed.cursor)
        assert isinstance(fresh, dg.SkipReason)


def test_ambiguous_batches_are_skipped_with_a_message(incoming):
    (incoming / "x.jsonl").write_text("{}\n")
    (incoming / "x.json").write_text("[]")
    (incoming / "y.json").write_text("[]")
    for p in incoming.iterdir():
        _age(p)
    cursor, changed, problems = scan_seed_files(incoming, {})
    assert set(changed) == {"y"}
    assert problems == ["batch 'x' skipped: x.json, x.jsonl all exist"]
    assert set(cursor) == {"x.json", "x.jsonl", "y.json"}


def test_automation_runs_downstream_when_a_new_batch_lands(incoming):
    """The aggregate re-runs after a new batch is ingested, even while another
    registered batch has never been materialized (its deps are 'missing')."""
    defs = build_definitions(load_spec())
    shutil.copyfile(DEMO_SEEDS, incoming / "demo.jsonl")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["demo", "not_yet"])
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert first.total_requested == 0

        assert dg.materialize(
            list(defs.assets),
            selection=["seed_problems", "seed_rejects"],
            partition_key="demo",
            instance=instance,
            resources=dict(defs.resources),
        ).success
        second = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=first.cursor
        )
        assert second.get_num_requested(dg.AssetKey("seed_catalog")) == 1
