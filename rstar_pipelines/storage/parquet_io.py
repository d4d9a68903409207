"""One Parquet file per asset partition, written with the stage's Arrow schema.

Layout under the lake directory: `<asset>.parquet` for unpartitioned assets and
`<asset>/<partition>.parquet` for partitioned ones (UPathIOManager's convention).
Empty tables are written like any other, so a stage that yields no rows still leaves
a typed file for its readers.

The lake is any filesystem fsspec knows (universal_pathlib's UPath): a local or NFS
directory, or an object store URL such as `s3://bucket/lake` (RSTAR_LAKE_URL), so
steps on many hosts read and write one lake.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from rstar_pipelines import settings
from rstar_pipelines.storage import schemas


def lake_path(path: str | os.PathLike) -> UPath:
    """A lake location as a UPath: a local path, or any fsspec URL."""
    return path if isinstance(path, UPath) else UPath(path)


def write_table(
    table: pa.Table, path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write atomically: a crash mid-write leaves the previous file, never a torn one
    (a temporary file beside it, then a rename: a local or NFS rename is atomic, and an
    object store shows the object only once it is complete)."""
    path = lake_path(path)
    if metadata:
        merged = {
            **(table.schema.metadata or {}),
            **{k.encode(): v.encode() for k, v in metadata.items()},
        }
        table = table.replace_schema_metadata(merged)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as out:
            pq.write_table(table, out)
        if isinstance(path, Path):  # local: os.replace overwrites atomically
            os.replace(tmp, path)
        else:
            path.fs.mv(tmp.path, path.path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_table(path: str | os.PathLike) -> pa.Table:
    path = lake_path(path)
    with path.open("rb") as source:
        return pq.read_table(source)


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
        write_table(_as_arrow(obj), path, provenance)

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
        return read_table(path)


class ParquetIOManager(dg.ConfigurableIOManagerFactory):
    """Stores row-valued assets as typed Parquet in the lake: `lake_dir` (a path or an
    fsspec URL), else RSTAR_LAKE_URL, else `<data dir>/lake`."""

    lake_dir: str | None = None

    def create_io_manager(self, context: dg.InitResourceContext) -> _ParquetUPathIO:
        return _ParquetUPathIO(base_path=lake_path(self.lake_dir or settings.lake_dir()))
