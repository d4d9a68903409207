"""The Dagster instance of a profile: its dagster.yaml, and the pools of pipeline.yaml
as cluster-wide limits.

Pool limits live in the instance's database (Postgres for `hosts` and `k8s`), so every
run on every host claims its steps' slots from the same counts; a step's slot is given
back when it ends, and the daemon frees those of a run that ended without giving them
back (crashed or cancelled: `run_monitoring.free_slots_after_run_end_seconds`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import dagster as dg
import yaml

TEMPLATES = Path(__file__).parent / "templates"
# Defaults for `rstar deploy init`: one GPU job at a time; LLM and sandbox steps mostly
# wait on servers, so several may run (size them to the servers: docs/scale-out.md).
DEFAULT_POOL_LIMITS = {"llm": 4, "sandbox": 4, "gpu": 1}


def instance_yaml(profile: str, max_concurrent_runs: int | None = None) -> str:
    """The profile's dagster.yaml (the `local` profile keeps Dagster's defaults)."""
    template = TEMPLATES / f"{profile}.yaml"
    if not template.exists():
        raise ValueError(f"profile {profile!r} has no instance template (use hosts or k8s)")
    text = template.read_text()
    if max_concurrent_runs is None:
        return text
    config = yaml.safe_load(text)
    config["concurrency"]["runs"]["max_concurrent_runs"] = max_concurrent_runs
    return yaml.safe_dump(config, sort_keys=False)


def pool_limits(declared: Mapping[str, str | None], overrides: Mapping[str, int]) -> dict[str, int]:
    """A limit for every pool pipeline.yaml declares (`declared`: asset key -> pool): the
    overrides, else the defaults."""
    pools = {pool for pool in declared.values() if pool}
    unknown = set(overrides) - pools
    if unknown:
        raise ValueError(
            f"pool limit for {', '.join(sorted(unknown))}: pipeline.yaml declares no such "
            f"pool (its pools: {', '.join(sorted(pools))})"
        )
    limits = {}
    for pool in sorted(pools):
        limit = overrides.get(pool, DEFAULT_POOL_LIMITS.get(pool, 1))
        if limit < 0:
            raise ValueError(f"pool {pool}: the limit must be 0 or more, got {limit}")
        limits[pool] = limit
    return limits


def apply_pool_limits(instance: dg.DagsterInstance, limits: Mapping[str, int]) -> None:
    for pool, limit in limits.items():
        instance.event_log_storage.set_concurrency_slots(pool, limit)


def init_instance(
    home: Path,
    profile: str,
    pools: Mapping[str, str | None],
    limits: Mapping[str, int],
    max_concurrent_runs: int | None = None,
) -> dict[str, int]:
    """Write `home`/dagster.yaml for the profile, create the instance's tables and set
    the limits of `pools` (asset key -> pool); returns the limits set."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(instance_yaml(profile, max_concurrent_runs))
    applied = pool_limits(pools, limits)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        apply_pool_limits(instance, applied)
    return applied
