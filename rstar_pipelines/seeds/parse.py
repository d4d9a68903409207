"""Reading a seed batch file into validated problem rows and rejected rows.

A batch is one JSONL, JSON (an array of objects) or Parquet file. A bad row never
fails the batch: it becomes a reject that says which line, which field and why. Nothing
is altered on the way in: text is read as strict UTF-8 (a leading byte-order mark is
allowed, anything else that is not UTF-8 fails the file with its line and byte offset,
never decoded with replacement characters), and NaN or infinite numbers are rejected
rather than kept as the text "nan".
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from rstar_pipelines.pipeline.stage import StageInputError

SEED_SUFFIXES = (".jsonl", ".json", ".parquet")
RAW_LIMIT = 2000
# The default of the ingestion's declared `max_problem_chars`.
MAX_PROBLEM_CHARS = 20_000
NON_FINITE_WORDS = ("nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity")


def _finite_answer(value: Any) -> Any:
    # Math answers are often written as bare numbers in JSON; accept them as text, but
    # never a NaN or an infinity (as a number, or as its spelling), which no answer is.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"answer is {value}, not a finite number")
        return str(value)
    if isinstance(value, str) and value.strip().lower() in NON_FINITE_WORDS:
        raise ValueError(f"answer is {value.strip()!r}, not a finite number")
    return value


NonEmptyText = Annotated[str, Field(min_length=1, strict=True)]
AnswerText = Annotated[str, BeforeValidator(_finite_answer), Field(min_length=1, strict=True)]


class Example(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stdin: Annotated[str, Field(strict=True)]
    stdout: Annotated[str, Field(strict=True)]


class _Seed(BaseModel):
    model_config = ConfigDict(extra="ignore", str_strip_whitespace=True)
    problem: NonEmptyText = Field(validation_alias=AliasChoices("problem", "question"))


class MathSeed(_Seed):
    domain: Literal["math"] = "math"
    answer: AnswerText


class CodeSeed(_Seed):
    domain: Literal["code"] = "code"
    oracle_solutions: Annotated[list[NonEmptyText], Field(min_length=1)]
    examples: list[Example] = []
    time_limit_s: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] | None = None


def problem_id(domain: str, problem: str, answer: str | None, oracle_solutions: list[str]) -> str:
    """Stable content hash: the same problem in any batch gets the same id."""
    basis = json.dumps(
        {
            "domain": domain,
            "problem": problem,
            "answer": answer,
            "oracle": sorted(oracle_solutions),
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(basis.encode("utf-8")).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


class SeedFileError(StageInputError):
    """The batch file as a whole cannot be read (not a single bad row)."""


def find_seed_file(directory: Path, batch: str) -> Path:
    found = [directory / f"{batch}{suffix}" for suffix in SEED_SUFFIXES]
    found = [p for p in found if p.is_file()]
    if not found:
        names = ", ".join(f"{batch}{s}" for s in SEED_SUFFIXES)
        raise SeedFileError(f"no seed file for batch {batch!r} in {directory} (looked for {names})")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise SeedFileError(f"batch {batch!r} is ambiguous: {names} all exist in {directory}")
    return found[0]


@dataclass
class ParsedBatch:
    problems: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _no_non_finite(constant: str) -> Any:
    raise ValueError(f"non-finite number {constant} (NaN and infinities are not allowed)")


def _loads(text: str) -> Any:
    """json.loads, except that NaN, Infinity and -Infinity are errors, not floats."""
    return json.loads(text, parse_constant=_no_non_finite)


def _utf8_text(path: Path) -> str:
    """The file as text: strict UTF-8 with an optional byte-order mark. Bytes that are not
    UTF-8 fail the whole file, naming the line and the byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
        offset = err.start + bom
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1)
        raise SeedFileError(
            f"{path}: not valid UTF-8 at line {line}, byte offset {offset} (byte {column} of "
            f"the line: {data[offset : offset + 4]!r}); re-encode the file as UTF-8"
        ) from None


def _records(path: Path) -> Iterator[tuple[int, str, Any, str | None]]:
    """(line, raw text, decoded object, decode error) for each record of the file."""
    suffix = path.suffix
    if suffix == ".jsonl":
        for number, text in enumerate(_utf8_text(path).split("\n"), start=1):
            if not text.strip():
                continue
            raw = text.rstrip("\r")
            try:
                yield number, raw, _loads(text), None
            except json.JSONDecodeError as err:
                yield number, raw, None, f"invalid JSON: {err.msg} (column {err.colno})"
            except ValueError as err:
                yield number, raw, None, f"invalid JSON: {err}"
        return
    if suffix == ".json":
        text = _utf8_text(path)
        try:
            data = _loads(text)
        except ValueError as err:  # json.JSONDecodeError included
            raise SeedFileError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, list):
            raise SeedFileError(f"{path}: a .json seed file must hold an array of objects")
        rows = data
    elif suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise SeedFileError(f"{path}: not a readable Parquet file: {err}") from None
    else:
        raise SeedFileError(f"{path}: unsupported seed file type (use {', '.join(SEED_SUFFIXES)})")
    for number, obj in enumerate(rows, start=1):
        yield number, json.dumps(obj, ensure_ascii=False, default=str), obj, None


def _validate(obj: Any) -> MathSeed | CodeSeed:
    if not isinstance(obj, dict):
        raise TypeError("expected a JSON object")
    domain = obj.get("domain", "code" if "oracle_solutions" in obj else "math")
    if domain == "math":
        return MathSeed.model_validate(obj)
    if domain == "code":
        return CodeSeed.model_validate(obj)
    raise LookupError(f"domain must be 'math' or 'code', got {domain!r}")


def _is_empty(path: Path) -> bool:
    """No bytes, or only whitespace (and a byte-order mark) in a text file."""
    size = path.stat().st_size
    if size == 0:
        return True
    if path.suffix == ".parquet" or size > 4096:
        return False
    return not path.read_bytes().removeprefix(b"\xef\xbb\xbf").strip()


def _seed_or_rejection(
    obj: Any, decode_error: str | None, max_problem_chars: int
) -> MathSeed | CodeSeed | tuple[str | None, str]:
    """A record's seed, or why it is rejected: the field at fault (None: the whole record)
    and the reason."""
    if decode_error:
        return None, decode_error
    try:
        seed = _validate(obj)
    except ValidationError as err:
        first = err.errors()[0]
        return ".".join(str(p) for p in first["loc"]) or None, first["msg"]
    except TypeError as err:
        return None, str(err)
    except LookupError as err:
        return "domain", str(err)
    if len(seed.problem) > max_problem_chars:
        return (
            "problem",
            f"problem is {len(seed.problem)} characters long, over the declared limit of "
            f"{max_problem_chars} (max_problem_chars)",
        )
    return seed


def _problem_row(seed: MathSeed | CodeSeed, batch: str, source_file: str, line: int) -> dict:
    """A seed_problems row: the seed with its id and where it was read."""
    answer = seed.answer if isinstance(seed, MathSeed) else None
    oracles = seed.oracle_solutions if isinstance(seed, CodeSeed) else []
    code = isinstance(seed, CodeSeed)
    return {
        "id": problem_id(seed.domain, seed.problem, answer, oracles),
        "batch": batch,
        "domain": seed.domain,
        "problem": seed.problem,
        "answer": answer,
        "oracle_solutions": oracles,
        "examples": [e.model_dump() for e in seed.examples] if code else [],
        "time_limit_s": seed.time_limit_s if code else None,
        "source_file": source_file,
        "source_line": line,
    }


def parse_seed_file(
    path: Path, batch: str, max_problem_chars: int = MAX_PROBLEM_CHARS
) -> ParsedBatch:
    """The batch's problems and rejects. A problem longer than `max_problem_chars` is
    rejected with its length; an empty file is an empty batch, with a warning."""
    out = ParsedBatch()
    seen: dict[str, int] = {}
    if _is_empty(path):
        out.warnings.append(f"{path.name} is empty: the batch has no problems")
        return out

    def reject(line: int, field_name: str | None, reason: str, raw: str) -> None:
        out.rejects.append(
            {
                "batch": batch,
                "source_file": path.name,
                "line": line,
                "field": field_name,
                "reason": reason,
                "raw": raw[:RAW_LIMIT],
            }
        )

    for line, raw, obj, decode_error in _records(path):
        seed = _seed_or_rejection(obj, decode_error, max_problem_chars)
        if isinstance(seed, tuple):
            reject(line, *seed, raw)
            continue
        row = _problem_row(seed, batch, path.name, line)
        if row["id"] in seen:
            reject(line, "problem", f"duplicate of line {seen[row['id']]}", raw)
            continue
        seen[row["id"]] = line
        out.problems.append(row)
    return out
