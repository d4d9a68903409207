"""The repository the tests run in: its paths, its commands, and the host's processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
DEMO_SEEDS = REPO / "assets" / "seeds" / "demo" / "demo.jsonl"

# The `dagster` and `rstar` commands of this environment.
DAGSTER = os.path.join(os.path.dirname(sys.executable), "dagster")
RSTAR = os.path.join(os.path.dirname(sys.executable), "rstar")
# Run config for the local profile's executor that keeps every step of a run in the run's
# process: no interpreter start per step.
IN_PROCESS_RUN = '{"execution": {"config": {"in_process": {}}}}'


def pipeline_copy(directory: Path, params: dict[str, dict]) -> Path:
    """A copy of the assets directory (for RSTAR_ASSETS_DIR) whose pipeline.yaml has each
    asset's `params` updated from `params[key]`, nested mappings merged key by key."""
    assets = directory / "assets"
    shutil.copytree(REPO / "assets", assets)
    doc = yaml.safe_load((assets / "pipeline.yaml").read_text())
    unknown = set(params) - {entry["key"] for entry in doc["assets"]}
    if unknown:
        raise KeyError(f"pipeline.yaml declares no asset {sorted(unknown)}")
    for entry in doc["assets"]:
        if entry["key"] in params:
            _merge(entry.setdefault("params", {}), params[entry["key"]])
    (assets / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return assets


def _merge(into: dict, update: dict) -> None:
    for name, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = value


def dagster_cli(*args: str) -> subprocess.CompletedProcess:
    """Run `dagster` from the repository root."""
    return subprocess.run(
        [DAGSTER, *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def materialize_seeds(defs, instance, batch: str):
    """Seed ingestion for `batch` through Dagster, as the seed-file sensor's run does."""
    import dagster as dg

    return dg.materialize(
        list(defs.assets),
        selection=["seed_problems", "seed_rejects"],
        partition_key=batch,
        instance=instance,
        resources=dict(defs.resources),
    )


def host_processes_matching(marker: str, ours: bool = False) -> list[str]:
    """Command lines of the host's processes that contain `marker`. With `ours`, only those
    this process started (its descendants) or left behind (orphans, adopted by pid 1): for a
    marker that is not unique to the test, since `make test`'s other worker runs its own."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if len(line.split(None, 2)) == 3]
    parent = {int(pid): int(ppid) for pid, ppid, _ in rows}

    def started_here(pid: int) -> bool:
        while pid not in (0, 1, os.getpid()):
            pid = parent.get(pid, 0)
        return pid != 0

    return [
        args
        for pid, _, args in rows
        if marker in args and "ps -eo" not in args and (not ours or started_here(int(pid)))
    ]
