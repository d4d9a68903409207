import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_pipelines.seeds.parse import SeedFileError, find_seed_file, parse_seed_file, problem_id
from rstar_pipelines.storage import schemas
from tests.conftest import DEMO_SEEDS

MALFORMED = "\n".join(
    [
        json.dumps({"problem": "What is 2+3?", "answer": 5}),
        '{"problem": "unterminated',
        json.dumps({"problem": "What is 7*6?"}),
        json.dumps({"domain": "code", "problem": "Echo.", "oracle_solutions": "print(input())"}),
        json.dumps(
            {
                "domain": "code",
                "problem": "Echo.",
                "oracle_solutions": ["print(input())"],
                "examples": [{"stdin": "1\n", "stdout": 1}],
            }
        ),
        "",
        json.dumps({"domain": "chemistry", "problem": "x", "answer": "y"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"problem": "What is 2+3?", "answer": "5"}),
        json.dumps(
            {
                "domain": "code",
                "problem": "Echo.",
                "oracle_solutions": ["print(input())"],
                "examples": [{"stdin": "hi\n", "stdout": "hi\n"}],
                "time_limit_s": 1.5,
            }
        ),
    ]
)


def test_malformed_rows_become_rejects_and_good_rows_are_kept(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(MALFORMED + "\n")
    parsed = parse_seed_file(path, "bad")

    assert [(p["source_line"], p["domain"]) for p in parsed.problems] == [(1, "math"), (10, "code")]
    assert parsed.problems[0]["answer"] == "5"  # a bare number is accepted as the answer text
    assert parsed.problems[1]["examples"] == [{"stdin": "hi\n", "stdout": "hi\n"}]
    assert parsed.problems[1]["time_limit_s"] == 1.5

    rejects = {r["line"]: (r["field"], r["reason"]) for r in parsed.rejects}
    assert rejects[2][0] is None and rejects[2][1].startswith("invalid JSON")
    assert rejects[3] == ("answer", "Field required")
    assert rejects[4] == ("oracle_solutions", "Input should be a valid list")
    assert rejects[5] == ("examples.0.stdout", "Input should be a valid string")
    assert rejects[7][0] == "domain" and "chemistry" in rejects[7][1]
    assert rejects[8] == (None, "expected a JSON object")
    assert rejects[9] == ("problem", "duplicate of line 1")
    assert len(parsed.rejects) == 7
    assert all(r["raw"] and r["batch"] == "bad" for r in parsed.rejects)

    # The tables the stage writes accept these rows as they are.
    pa.Table.from_pylist(parsed.problems, schema=schemas.SEED_PROBLEMS)
    pa.Table.from_pylist(parsed.rejects, schema=schemas.SEED_REJECTS)


def test_ids_are_stable_content_hashes(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(json.dumps({"problem": "What is 2+3?", "answer": "5"}) + "\n")
    b.write_text("\n" + json.dumps({"answer": "5", "problem": "  What is 2+3?  "}) + "\n")
    (pa_row,), (pb_row,) = parse_seed_file(a, "a").problems, parse_seed_file(b, "b").problems
    assert pa_row["id"] == pb_row["id"] == problem_id("math", "What is 2+3?", "5", [])
    assert problem_id("math", "What is 2+3?", "6", []) != pa_row["id"]


def test_demo_batch_is_clean():
    parsed = parse_seed_file(DEMO_SEEDS, "demo")
    assert parsed.rejects == []
    domains = [p["domain"] for p in parsed.problems]
    assert domains.count("math") >= 24 and domains.count("code") >= 8
    code = [p for p in parsed.problems if p["domain"] == "code"]
    assert all(p["oracle_solutions"] and p["examples"] for p in code)


def test_math500_json_array_with_question_alias(math500):
    parsed = parse_seed_file(math500, "math500")
    assert len(parsed.problems) == 500 and parsed.rejects == []
    first = parsed.problems[0]
    assert first["domain"] == "math" and first["problem"].startswith("Convert the point")
    assert first["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_parquet_seed_file(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"problem": ["What is 1+1?", ""], "answer": ["2", "3"]}), path)
    parsed = parse_seed_file(path, "p")
    assert len(parsed.problems) == 1
    assert parsed.rejects[0]["line"] == 2 and parsed.rejects[0]["field"] == "problem"


def test_whole_file_errors_name_the_file(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(SeedFileError, match="x.json: not valid JSON"):
        parse_seed_file(tmp_path / "x.json", "x")
    with pytest.raises(SeedFileError, match="no seed file for batch 'y'"):
        find_seed_file(tmp_path, "y")
    (tmp_path / "z.jsonl").write_text("")
    (tmp_path / "z.parquet").write_text("")
    with pytest.raises(SeedFileError, match="ambiguous"):
        find_seed_file(tmp_path, "z")
