"""One Parquet file per asset partition, written with the stage's Arrow schema.

Layout under the lake directory: `<asset>.parquet` for unpartitioned assets and
`<asset>/<partition>.parquet` for partitioned ones (UPathIOManager's convention).
Empty tables are written like any other, so a stage that yields no rows still leaves
a typed file for its readers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from rstar_pipelines import settings
from rstar_pipelines.storage import schemas


def write_table(table: pa.Table, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically: a crash mid-write leaves the previous file, never a torn one."""
    if metadata:
        merged = {
            **(table.schema.metadata or {}),
            **{k.encode(): v.encode() for k, v in metadata.items()},
        }
        table = table.replace_schema_metadata(merged)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_table(path: Path) -> pa.Table:
    return pq.read_table(path)


def _as_arrow(obj: Any) -> pa.Table:
    if isinstance(obj, pa.Table):
        return obj
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas ships with dagster's set
        pd = None
    if pd is not None and isinstance(obj, pd.DataFrame):
        return pa.Table.from_pandas(obj, preserve_index=False)
    raise TypeError(f"expected a pyarrow.Table or pandas.DataFrame, got {type(obj).__name__}")


class _ParquetUPathIO(dg.UPathIOManager):
    extension = ".parquet"

    def dump_to_path(self, context: dg.OutputContext, obj: Any, path: UPath) -> None:
        provenance = {"rstar.asset": context.asset_key.to_user_string()}
        if context.has_asset_partitions:
            provenance["rstar.partition"] = context.asset_partition_key
        if context.version:
            provenance["rstar.code_version"] = context.version
        if context.run_id:
            provenance["rstar.run_id"] = context.run_id
        write_table(_as_arrow(obj), Path(path), provenance)

    def get_metadata(self, context: dg.OutputContext, obj: Any) -> dict[str, Any]:
        # A one-row table that points at an artifact (a checkpoint directory): the
        # materialization's `path` is the artifact, `parquet_file` the row that records it.
        table = _as_arrow(obj)
        column = schemas.artifact_column(table.schema)
        if column is None or table.num_rows != 1 or table[column][0].as_py() is None:
            return {}
        return {
            "path": dg.MetadataValue.path(table[column][0].as_py()),
            "parquet_file": dg.MetadataValue.path(str(self._get_path(context))),
        }

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pa.Table:
        return read_table(Path(path))


class ParquetIOManager(dg.ConfigurableIOManagerFactory):
    """Stores row-valued assets as typed Parquet under `<data dir>/lake`."""

    lake_dir: str | None = None

    def create_io_manager(self, context: dg.InitResourceContext) -> _ParquetUPathIO:
        base = Path(self.lake_dir) if self.lake_dir else settings.lake_dir()
        return _ParquetUPathIO(base_path=UPath(base))
