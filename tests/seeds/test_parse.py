import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_pipelines.seeds.parse import SeedFileError, find_seed_file, parse_seed_file, problem_id
from rstar_pipelines.storage import schemas
from tests.fakes.repo import DEMO_SEEDS

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


# -- files that must not lose or alter a row ---------------------------------------------


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path):
    rows = [{"problem": "What is 2+3?", "answer": "5"}, {"problem": "What is 1+1?", "answer": 2}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    for name in ("bom.jsonl", "bom.json"):
        parsed = parse_seed_file(tmp_path / name, "bom")
        assert parsed.rejects == []
        assert [p["problem"] for p in parsed.problems] == ["What is 2+3?", "What is 1+1?"]
        assert [p["answer"] for p in parsed.problems] == ["5", "2"]


def test_non_finite_numbers_are_rejected_with_their_reason(tmp_path):
    lines = [
        '{"problem": "What is 0/0?", "answer": NaN}',
        '{"problem": "What is 1/0?", "answer": Infinity}',
        '{"problem": "What is -1/0?", "answer": -Infinity}',
        json.dumps({"problem": "Undefined?", "answer": "NaN"}),
        json.dumps({"problem": "Forever?", "answer": " inf "}),
        '{"domain": "code", "problem": "Echo.", "oracle_solutions": ["print(input())"],'
        ' "time_limit_s": Infinity}',
        json.dumps({"problem": "What is 2+2?", "answer": 4.0}),
    ]
    path = tmp_path / "nan.jsonl"
    path.write_text("\n".join(lines) + "\n")
    parsed = parse_seed_file(path, "nan")
    assert [(p["source_line"], p["answer"]) for p in parsed.problems] == [(7, "4.0")]
    reasons = {r["line"]: (r["field"], r["reason"]) for r in parsed.rejects}
    for line, constant in ((1, "NaN"), (2, "Infinity"), (3, "-Infinity")):
        assert reasons[line] == (
            None,
            f"invalid JSON: non-finite number {constant} (NaN and infinities are not allowed)",
        )
    assert reasons[4] == ("answer", "Value error, answer is 'NaN', not a finite number")
    assert reasons[5] == ("answer", "Value error, answer is 'inf', not a finite number")
    assert reasons[6] == reasons[2]  # time_limit_s: Infinity

    # A Parquet float column holds real NaNs: rejected the same way.
    pq.write_table(
        pa.table({"problem": ["a?", "b?"], "answer": [float("nan"), 3.5]}),
        tmp_path / "nan.parquet",
    )
    parsed = parse_seed_file(tmp_path / "nan.parquet", "nan")
    assert [p["answer"] for p in parsed.problems] == ["3.5"]
    assert [(r["line"], r["field"], r["reason"]) for r in parsed.rejects] == [
        (1, "answer", "Value error, answer is nan, not a finite number")
    ]
    code = {"domain": ["code"], "problem": ["Echo."], "oracle_solutions": [["print(input())"]]}
    pq.write_table(pa.table({**code, "time_limit_s": [float("inf")]}), tmp_path / "t.parquet")
    [reject] = parse_seed_file(tmp_path / "t.parquet", "t").rejects
    assert (reject["field"], reject["reason"]) == (
        "time_limit_s",
        "Input should be a finite number",
    )


def test_a_file_that_is_not_utf8_fails_with_the_line_and_byte_offset(tmp_path):
    good = json.dumps({"problem": "What is 2+3?", "answer": "5"}) + "\n"
    latin1 = json.dumps({"problem": "Résumé?", "answer": "x"}, ensure_ascii=False) + "\n"
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good.encode() + latin1.encode("latin-1"))
    offset = len(good.encode()) + latin1.encode("latin-1").index(b"\xe9")
    column = offset - len(good.encode())
    with pytest.raises(SeedFileError) as err:
        parse_seed_file(path, "latin1")
    message = str(err.value)
    assert f"not valid UTF-8 at line 2, byte offset {offset} (byte {column} of the line" in message
    assert "\ufffd" not in message

    (tmp_path / "latin1.json").write_bytes(b"[" + latin1.strip().encode("latin-1") + b"]")
    with pytest.raises(SeedFileError, match="not valid UTF-8 at line 1, byte offset 15"):
        parse_seed_file(tmp_path / "latin1.json", "latin1")


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.jsonl", b""),
        ("blank.jsonl", b"\n \n"),
        ("empty.json", b""),
        ("bom_only.json", b"\xef\xbb\xbf\n"),
        ("empty.parquet", b""),
    ],
)
def test_an_empty_file_is_an_empty_batch_with_a_warning(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    parsed = parse_seed_file(tmp_path / name, "empty")
    assert parsed.problems == [] and parsed.rejects == []
    assert parsed.warnings == [f"{name} is empty: the batch has no problems"]


def test_problems_over_the_declared_length_are_rejected_with_their_length(tmp_path):
    long = "x" * 5000
    path = tmp_path / "long.jsonl"
    rows = [{"problem": long, "answer": "1"}, {"problem": "short?", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parsed = parse_seed_file(path, "long", max_problem_chars=4000)
    assert [p["problem"] for p in parsed.problems] == ["short?"]
    [reject] = parsed.rejects
    assert (reject["line"], reject["field"]) == (1, "problem")
    assert reject["reason"] == (
        "problem is 5000 characters long, over the declared limit of 4000 (max_problem_chars)"
    )
    assert len(reject["raw"]) == 2000  # the raw row is kept, cut to RAW_LIMIT
    # Under the default limit the same problem is kept whole.
    assert parse_seed_file(path, "long").problems[0]["problem"] == long
