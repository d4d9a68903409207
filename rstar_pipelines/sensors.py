"""Sensors: new seed files become partitions and runs; declared automation runs downstream."""

from __future__ import annotations

import json
import time
from pathlib import Path

import dagster as dg

from rstar_pipelines.partitions import seed_batches
from rstar_pipelines.pipeline.spec import DeclaredAsset
from rstar_pipelines.seeds.parse import SEED_SUFFIXES, file_sha256

# A file modified this recently may still be being copied in; look again next tick.
SETTLE_SECONDS = 2.0


def scan_seed_files(
    directory: Path, cursor: dict[str, list], now: float | None = None
) -> tuple[dict[str, list], dict[str, list], list[str]]:
    """Fingerprint the seed files in `directory`.

    Returns the new cursor ({file name: [mtime_ns, size, sha256]}; unchanged files are
    not hashed again), the batches whose file is new or whose content changed
    ({batch: [mtime_ns, size, sha256]}), and problems found, each as a message.
    """
    now = time.time() if now is None else now
    new_cursor: dict[str, list] = {}
    by_batch: dict[str, list[Path]] = {}
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.name.startswith(".") or path.suffix not in SEED_SUFFIXES or not path.is_file():
                continue
            stat = path.stat()
            if now - stat.st_mtime < SETTLE_SECONDS:
                continue
            previous = cursor.get(path.name)
            if previous and previous[:2] == [stat.st_mtime_ns, stat.st_size]:
                new_cursor[path.name] = previous
            else:
                new_cursor[path.name] = [stat.st_mtime_ns, stat.st_size, file_sha256(path)]
            by_batch.setdefault(path.stem, []).append(path)
    changed, problems = {}, []
    for batch, paths in sorted(by_batch.items()):
        if len(paths) > 1:
            problems.append(
                f"batch {batch!r} skipped: {', '.join(p.name for p in paths)} all exist"
            )
            continue
        name = paths[0].name
        previous_sha = cursor[name][2] if name in cursor else None
        if new_cursor[name][2] != previous_sha:
            changed[batch] = new_cursor[name]
    return new_cursor, changed, problems


def ingested_sha256(instance: dg.DagsterInstance, asset_key: str, batch: str) -> str | None:
    """The content hash of the file that the latest materialization of `batch` ingested
    (its `source_sha256` metadata), whoever ran it: this sensor, `rstar demo`, the CLI."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset_key), asset_partitions=[batch]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    value = records[0].asset_materialization.metadata.get("source_sha256")
    return value.value if value is not None else None


def seed_file_sensor(ingestion: DeclaredAsset) -> dg.SensorDefinition:
    """Adds a partition for each new seed file and runs ingestion for it. A file whose
    content its batch's latest materialization already ingested starts no run (so a
    first tick after `rstar demo` finds nothing to do). The run key carries the file's
    content hash, so a file changed in place is ingested again."""
    stage = ingestion.stage()

    @dg.sensor(
        name=f"{ingestion.key}_files",
        target=dg.AssetSelection.assets(*ingestion.output_keys()),
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Watches {ingestion.params.incoming_dir} (under the data directory) for "
        f"seed batch files ({', '.join(SEED_SUFFIXES)}).",
    )
    def _sensor(context: dg.SensorEvaluationContext):
        cursor = json.loads(context.cursor) if context.cursor else {}
        new_cursor, changed, problems = scan_seed_files(stage.incoming_dir(), cursor)
        for problem in problems:
            context.log.warning(problem)
        if not changed and new_cursor == cursor:
            return dg.SkipReason(f"no new or changed seed files in {stage.incoming_dir()}")
        known = set(context.instance.get_dynamic_partitions(seed_batches.name))
        new_batches = sorted(set(changed) - known)
        run_requests = []
        for batch, (mtime_ns, _size, sha) in changed.items():
            if batch in known and ingested_sha256(context.instance, ingestion.key, batch) == sha:
                context.log.info(f"batch {batch!r}: this content is already ingested")
                continue
            run_requests.append(
                dg.RunRequest(
                    partition_key=batch,
                    run_key=f"{batch}:{sha[:16]}:{mtime_ns}",
                    tags={"rstar/seed_sha256": sha},
                )
            )
        return dg.SensorResult(
            run_requests=run_requests,
            dynamic_partitions_requests=[seed_batches.build_add_request(new_batches)]
            if new_batches
            else [],
            cursor=json.dumps(new_cursor, sort_keys=True),
        )

    return _sensor


def automation_sensor() -> dg.AutomationConditionSensorDefinition:
    # Declared so it starts RUNNING: Dagster's implicit one starts stopped.
    return dg.AutomationConditionSensorDefinition(
        "rstar_automation",
        target=dg.AssetSelection.all(),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
    )
