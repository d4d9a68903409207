"""DuckDB over the Parquet lake: one view per asset, in a throwaway in-memory database.

An in-memory connection takes no file lock, so queries never contend with runs that
are writing (DuckDB's single-writer lock is why a DuckDB file is not the store).
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
from upath import UPath

from rstar_pipelines import settings


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def asset_views(lake: UPath) -> dict[str, str]:
    """View name -> the read_parquet expression that serves it."""
    views: dict[str, str] = {}
    if not lake.is_dir():
        return views
    for entry in sorted(lake.iterdir()):
        if entry.is_dir() and any(entry.glob("*.parquet")):
            views[entry.name] = (
                f"read_parquet({_sql_str(str(entry / '*.parquet'))}, union_by_name = true)"
            )
        elif entry.suffix == ".parquet" and entry.is_file():
            views[entry.stem] = f"read_parquet({_sql_str(str(entry))})"
    return views


def connect(lake_dir: str | os.PathLike | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view for every asset in the lake (a local
    directory, or any fsspec URL: DuckDB reads through the same filesystem)."""
    lake = UPath(lake_dir) if lake_dir is not None else settings.lake_dir()
    con = duckdb.connect(":memory:")
    if not isinstance(lake, Path):
        con.register_filesystem(lake.fs)
    for name, source in asset_views(lake).items():
        con.execute(f'CREATE VIEW "{name}" AS SELECT * FROM {source}')
    return con


def query(sql: str, lake_dir: str | os.PathLike | None = None) -> pa.Table:
    """Run SQL against the asset views and return the result as an Arrow table."""
    con = connect(lake_dir)
    try:
        relation = con.sql(sql)
        # Statements that return no rows (CREATE, SET, ...) give no relation.
        return relation.to_arrow_table() if relation is not None else pa.table({})
    finally:
        con.close()
