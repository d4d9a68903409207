"""Arrow schemas of the tables the pipeline writes: the data contracts of ARCHITECTURE §4.

Nested values are lists and structs, never JSON inside strings, so DuckDB and
pyarrow readers see real types.
"""

from __future__ import annotations

import pyarrow as pa

EXAMPLE = pa.struct([("stdin", pa.string()), ("stdout", pa.string())])

SEED_PROBLEMS = pa.schema(
    [
        ("id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("oracle_solutions", pa.list_(pa.string())),
        ("examples", pa.list_(EXAMPLE)),
        ("time_limit_s", pa.float64()),
        ("source_file", pa.string()),
        ("source_line", pa.int64()),
    ]
)

SEED_REJECTS = pa.schema(
    [
        ("batch", pa.string()),
        ("source_file", pa.string()),
        ("line", pa.int64()),
        ("field", pa.string()),
        ("reason", pa.string()),
        ("raw", pa.string()),
    ]
)

SEED_CATALOG = pa.schema(
    [
        ("batch", pa.string()),
        ("math_problems", pa.int64()),
        ("code_problems", pa.int64()),
        ("code_with_examples", pa.int64()),
        ("rejected_rows", pa.int64()),
    ]
)
