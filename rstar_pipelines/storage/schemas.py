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

# -- the verification chain (rStar-Coder) -----------------------------------------------

SYNTHESIZED_PROBLEMS = pa.schema(
    [
        ("id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("answer", pa.string()),  # seeds' given answer; synthesized math: decided by voting
        ("oracle_solutions", pa.list_(pa.string())),
        ("examples", pa.list_(EXAMPLE)),
        ("time_limit_s", pa.float64()),
        ("is_seed", pa.bool_()),
        ("seed_id", pa.string()),
        ("model", pa.string()),
    ]
)

SCALE = pa.struct([("name", pa.string()), ("value", pa.int64())])

TEST_INPUTS = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("generated", pa.int64()),
        ("valid", pa.int64()),
        ("kept", pa.int64()),
        ("largest_ok_scale", pa.list_(SCALE)),
        ("generator", pa.string()),
        ("parse_error", pa.string()),
        ("errors", pa.list_(pa.string())),
        ("model", pa.string()),
    ]
)

CANDIDATE_SOLUTIONS = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("candidate_index", pa.int64()),
        ("text", pa.string()),
        ("program", pa.string()),
        ("answer", pa.string()),
        ("parse_error", pa.string()),
        ("finish_reason", pa.string()),
        ("completion_tokens", pa.int64()),
        ("model", pa.string()),
    ]
)

CANDIDATE_VERDICT = pa.struct(
    [
        ("candidate_id", pa.string()),
        ("candidate_index", pa.int64()),
        ("agrees", pa.bool_()),
        ("status", pa.string()),
        ("answer", pa.string()),
        ("wall_s", pa.float64()),
        ("cpu_s", pa.float64()),
        ("peak_memory_mb", pa.float64()),
    ]
)

VERIFIED_OUTPUTS = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("verified", pa.bool_()),
        ("reason", pa.string()),
        ("label_source", pa.string()),  # "majority", "oracle" or "given" (seed answer)
        ("agreement", pa.float64()),
        ("answer", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("labels", pa.list_(pa.string())),
        ("candidates", pa.list_(CANDIDATE_VERDICT)),
    ]
)

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
# open-r1's layout for verifiable code problems.
VERIFICATION_INFO = pa.struct(
    [
        ("language", pa.string()),
        (
            "test_cases",
            pa.list_(
                pa.struct([("input", pa.string()), ("output", pa.string()), ("type", pa.string())])
            ),
        ),
    ]
)

VERIFIED_SOLUTIONS = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("candidate_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("solution", pa.string()),
        ("program", pa.string()),
        ("answer", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("verification_info", VERIFICATION_INFO),
        ("agreement", pa.float64()),
        ("label_source", pa.string()),
        ("cpu_s", pa.float64()),
        ("model", pa.string()),
    ]
)
