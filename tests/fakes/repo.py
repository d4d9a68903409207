"""The repository the tests run in: its paths, its commands, and the host's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
DEMO_SEEDS = REPO / "assets" / "seeds" / "demo" / "demo.jsonl"

# The `dagster` and `rstar` commands of this environment.
DAGSTER = os.path.join(os.path.dirname(sys.executable), "dagster")
RSTAR = os.path.join(os.path.dirname(sys.executable), "rstar")


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


def host_processes_matching(marker: str) -> list[str]:
    """Command lines of the host's processes that contain `marker`."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]
