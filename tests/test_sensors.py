import json
import os
import shutil
import time

import dagster as dg

from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.sensors import scan_seed_files
from tests.fakes.repo import DEMO_SEEDS, materialize_seeds


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

        assert materialize_seeds(defs, instance, "demo").success
        second = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=first.cursor
        )
        assert second.get_num_requested(dg.AssetKey("seed_catalog")) == 1


# -- start-up after `rstar demo`: nothing done is redone ---------------------------------


def _demo_state(instance, defs, incoming):
    """The instance as `rstar demo` leaves it: the demo file ingested by a real run (its
    materialization carries the file's hash), every other asset materialized after it in
    dependency order (reported as runless events: what they hold does not matter here)."""
    shutil.copyfile(DEMO_SEEDS, incoming / "demo.jsonl")
    _age(incoming / "demo.jsonl")
    instance.add_dynamic_partitions("seed_batches", ["demo"])
    assert materialize_seeds(defs, instance, "demo").success
    graph = defs.resolve_asset_graph()
    for key in graph.toposorted_asset_keys:
        if key.to_user_string() not in ("seed_problems", "seed_rejects"):
            _report(instance, graph, key)
    return graph


def _report(instance, graph, key):
    partition = "demo" if graph.get(key).partitions_def else None
    instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=partition))


def _ancestors(graph, key):
    found, todo = set(), [key]
    while todo:
        for parent in graph.get(todo.pop()).parent_keys:
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


def test_no_run_after_the_demo_and_one_for_a_changed_file(incoming):
    defs = build_definitions(load_spec())
    sensor = defs.resolve_sensor_def("seed_problems_files")
    with dg.instance_for_test() as instance:
        _demo_state(instance, defs, incoming)

        # The first tick of `make dev`: the file is the one the demo ingested.
        first, _ = _tick(sensor, instance, defs, None)
        assert first.run_requests == [] and not first.dynamic_partitions_requests
        assert "demo.jsonl" in json.loads(first.cursor)
        assert isinstance(_tick(sensor, instance, defs, first.cursor)[0], dg.SkipReason)
        automation = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert automation.total_requested == 0
        again = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=automation.cursor
        )
        assert again.total_requested == 0

        # The file changes: one run, for its batch; a new file: one run and a partition.
        with (incoming / "demo.jsonl").open("a") as fh:
            fh.write(json.dumps({"problem": "What is 9-4?", "answer": "5"}) + "\n")
        _age(incoming / "demo.jsonl", 5)
        shutil.copyfile(DEMO_SEEDS, incoming / "more.jsonl")
        _age(incoming / "more.jsonl")
        changed, _ = _tick(sensor, instance, defs, first.cursor)
        assert sorted(r.partition_key for r in changed.run_requests) == ["demo", "more"]
        assert changed.dynamic_partitions_requests[0].partition_keys == ["more"]


def test_automation_requests_each_asset_once_after_its_upstream(incoming):
    """A re-ingested batch flows down the lineage tick by tick: every asset is requested
    exactly once, never on a tick where one of its ancestors is still to update, except
    together with same-partitioning ancestors (one run, in dependency order)."""
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        graph = _demo_state(instance, defs, incoming)
        cursor = dg.evaluate_automation_conditions(defs=defs, instance=instance).cursor
        _report(instance, graph, dg.AssetKey("seed_problems"))
        _report(instance, graph, dg.AssetKey("seed_rejects"))

        requested_at: dict[dg.AssetKey, list[int]] = {}
        for tick in range(40):
            result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
            cursor = result.cursor
            keys = [k for k in graph.toposorted_asset_keys if result.get_num_requested(k)]
            if not keys and tick > 0:
                break
            for key in keys:  # the runs of this tick, finished before the next one
                requested_at.setdefault(key, []).append(tick)
                _report(instance, graph, key)
        else:
            raise AssertionError("automation never settled")

        automated = {
            k for k in graph.materializable_asset_keys if graph.get(k).automation_condition
        }
        assert set(requested_at) == automated
        assert all(len(ticks) == 1 for ticks in requested_at.values()), requested_at
        for key, (tick,) in requested_at.items():
            for up in _ancestors(graph, key) & set(requested_at):
                (up_tick,) = requested_at[up]
                same_run = graph.get(up).partitions_def == graph.get(key).partitions_def
                assert up_tick < tick or (up_tick == tick and same_run), (up, key)
        # The case: the evaluations wait for the retrained policy (they share its
        # run), and the aggregates for the batch's search (a run of its own).
        tick_of = {k.to_user_string(): t for k, (t,) in requested_at.items()}
        assert tick_of["dser_eval"] == tick_of["mcts_eval"] == tick_of["policy_checkpoint"]
        assert tick_of["ppm_pairs"] > tick_of["mcts_nodes"] == tick_of["synthesized_problems"]


def test_the_daily_schedule_refreshes_only_aggregates_behind_their_upstream(incoming):
    defs = build_definitions(load_spec())
    schedule = defs.resolve_schedule_def("daily_aggregates")
    with dg.instance_for_test() as instance:
        graph = _demo_state(instance, defs, incoming)
        context = dg.build_schedule_context(instance=instance)
        assert isinstance(schedule.evaluate_tick(context).skip_message, str)

        _report(instance, graph, dg.AssetKey("mcts_nodes"))
        [request] = schedule.evaluate_tick(
            dg.build_schedule_context(instance=instance)
        ).run_requests
        assert {k.to_user_string() for k in request.asset_selection} == {"ppm_pairs", "sft_dataset"}


def test_an_aggregate_waits_for_an_unpartitioned_upstream_that_was_never_materialized(incoming):
    """dser_eval reads policy_checkpoint: with the batch verified but no policy trained yet,
    it is not requested (it would fail); a missing batch does not block it."""
    defs = build_definitions(load_spec())
    with dg.instance_for_test() as instance:
        # Resolved inside the test instance: Dagster reads the current instance's state
        # storage while it loads definitions.
        graph = defs.resolve_asset_graph()
        instance.add_dynamic_partitions("seed_batches", ["demo", "not_yet"])
        for key in graph.toposorted_asset_keys:
            if graph.get(key).partitions_def is not None:
                _report(instance, graph, key)
        cursor = dg.evaluate_automation_conditions(defs=defs, instance=instance).cursor
        _report(instance, graph, dg.AssetKey("verified_outputs"))
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        assert result.get_num_requested(dg.AssetKey("mcts_trajectories")) == 1
        assert result.get_num_requested(dg.AssetKey("dser_eval")) == 0
        assert result.get_num_requested(dg.AssetKey("grpo_roc_checkpoint")) == 0
