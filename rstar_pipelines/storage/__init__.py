"""Parquet files as the system of record, DuckDB as the query layer over them."""

from rstar_pipelines.storage.parquet_io import ParquetIOManager, read_table, write_table
from rstar_pipelines.storage.query import connect, query

__all__ = ["ParquetIOManager", "connect", "query", "read_table", "write_table"]
