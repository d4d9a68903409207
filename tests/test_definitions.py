import json
import os
import subprocess
import sys

import dagster as dg

from rstar_pipelines.definitions import defs
from tests.fakes.repo import REPO, dagster_cli

SNAPSHOT = REPO / "tests" / "snapshots" / "asset_graph.json"


def asset_graph_snapshot(definitions: dg.Definitions) -> dict:
    graph = definitions.resolve_asset_graph()
    snapshot = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        partitions = node.partitions_def
        snapshot[key.to_user_string()] = {
            "deps": sorted(p.to_user_string() for p in node.parent_keys),
            "partitioning": getattr(partitions, "name", None) if partitions else None,
            "group": node.group_name,
            "automation": node.automation_condition.get_label()
            if node.automation_condition
            else None,
        }
    return snapshot


def test_asset_graph_matches_snapshot():
    """Guards the lineage: regenerate with RSTAR_UPDATE_SNAPSHOTS=1 when a change is meant."""
    current = asset_graph_snapshot(defs)
    if os.environ.get("RSTAR_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(json.dumps(current, indent=2) + "\n")
    assert current == json.loads(SNAPSHOT.read_text())


def test_dagster_definitions_validate():
    # Bare invocation finds the same code location through pyproject's [tool.dg].
    for pointer in (["-m", "rstar_pipelines.definitions"], []):
        proc = dagster_cli("definitions", "validate", *pointer)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_code_location_loads_without_heavy_imports():
    code = (
        "import sys, rstar_pipelines.definitions; "
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'triton') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_sensors_and_schedule_are_declared_running():
    assert (
        defs.resolve_sensor_def("rstar_automation").default_status == dg.DefaultSensorStatus.RUNNING
    )
    schedule = defs.resolve_schedule_def("daily_aggregates")
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert schedule.cron_schedule == "0 3 * * *"
    job = defs.resolve_job_def(schedule.job_name)
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {
        "seed_catalog",
        "problem_groups",
        "ppm_pairs",
        "sft_dataset",
        "grpo_roc_data",
        "gate_distill_data",
    }
