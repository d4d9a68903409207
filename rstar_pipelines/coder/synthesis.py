"""Parsing the problems a model synthesizes from a seed (rStar-Coder step 2, docs/rstar-coder.md).

The formats are the ones the templates ask for: assets/prompts/synthesize_code.jinja
(``### Problem``, ``### Input``, ``### Output``, ``### Examples`` with fenced example
blocks labelled ``Input:`` / ``Output:``) and synthesize_math.jinja (``New problem:``).
A completion that does not follow the format is a `ParseFailure` with a short, fixed
reason, so the failures of a batch can be counted by cause.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import NamedTuple

from rstar_pipelines.coder.extract import fenced_blocks
from rstar_pipelines.heldout import normalized_text

__all__ = [
    "MAX_STATEMENT_CHARS",
    "ParseFailure",
    "SynthesizedProblem",
    "normalized_text_hash",
    "parse_synthesized_code",
    "parse_synthesized_math",
]

MAX_STATEMENT_CHARS = 4000


@dataclass(frozen=True)
class SynthesizedProblem:
    problem: str  # code: description, then "Input" and "Output" sections, like the seeds
    examples: tuple[tuple[str, str], ...] = ()  # (stdin, stdout); empty for math


@dataclass(frozen=True)
class ParseFailure:
    reason: str


def normalized_text_hash(text: str) -> str:
    """A near-duplicate key: equal for texts that differ only in case, spacing or punctuation."""
    return hashlib.sha256(normalized_text(text).encode("utf-8")).hexdigest()[:16]


# The worked examples inside the synthesis templates: a small model copies them verbatim.
_FORMAT_EXAMPLES = frozenset(
    normalized_text_hash(text)
    for text in (
        "Given n integers, print the difference between the largest and the smallest of them.",
        "Tom has 3 bags with 4 apples in each bag. He eats 2 apples. How many apples are left?",
        "A shelf has 5 rows with 6 books in each row. Ana takes away 7 books. How many books "
        "are left?",
    )
)
_FORMAT_EXAMPLE_IO = frozenset({("3\n4 -2 7\n", "9\n"), ("1\n5\n", "0\n")})

# "### Problem", "## New Problem: Title", "### Input Format", "### Example 1", ...; the rest
# of the heading line (a title, say) belongs to the section.
_HEADING = re.compile(
    r"^[ \t]*#{1,6}[ \t]*(?:\*\*)?[ \t]*(?:new[ \t]+)?(problem|input|output|example)s?\b"
    r"(?:[ \t]+(?:format|description|statement|specification)\b)?[ \t*:.-]*(.*?)[ \t*]*$",
    re.IGNORECASE | re.MULTILINE,
)


class _Section(NamedTuple):
    kind: str  # "problem", "input", "output" or "example"
    body: str
    offset: int  # where its heading starts in the completion


def _sections(text: str) -> list[_Section]:
    """One per known heading; unknown headings ("### Constraints") stay inside the body."""
    headings = list(_HEADING.finditer(text))
    sections = []
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        body = f"{heading.group(2)}\n{text[heading.end() : end]}".strip()
        sections.append(_Section(heading.group(1).lower(), body, heading.start()))
    return sections


def parse_synthesized_code(completion: str) -> SynthesizedProblem | ParseFailure:
    sections = _sections(completion)
    starts = [i for i, section in enumerate(sections) if section.kind == "problem"]
    if not starts:
        return ParseFailure("no problem section")
    # The last problem wins: an analysis may sketch a draft before the final statement.
    first: dict[str, _Section] = {}
    for section in sections[starts[-1] :]:
        first.setdefault(section.kind, section)
    description = first["problem"].body
    input_format = first["input"].body if "input" in first else ""
    output_format = first["output"].body if "output" in first else ""
    if not description:
        return ParseFailure("empty problem")
    if normalized_text_hash(description) in _FORMAT_EXAMPLES:
        return ParseFailure("copy of the format example")
    if not input_format:
        return ParseFailure("missing input format")
    if not output_format:
        return ParseFailure("missing output format")
    statement = f"{description}\n\nInput\n{input_format}\n\nOutput\n{output_format}\n"
    if len(statement) > MAX_STATEMENT_CHARS:
        return ParseFailure("too long")
    if "example" not in first:
        return ParseFailure("no examples")
    # Everything after the heading: examples labelled "#### Input" are headings themselves.
    examples = _examples(completion[first["example"].offset :])
    if isinstance(examples, ParseFailure):
        return examples
    if set(examples) <= _FORMAT_EXAMPLE_IO:
        return ParseFailure("copy of the format example")
    return SynthesizedProblem(problem=statement, examples=examples)


def _examples(text: str) -> tuple[tuple[str, str], ...] | ParseFailure:
    """Pairs of fenced blocks, each labelled by the line above it; unlabelled ones are skipped.

    Only fenced values count: an inline ``Input: 3 4`` cannot say where a multi-line
    input ends. A truncated example (its last fence left open) has no output.
    """
    lines = text.splitlines()
    pairs = []
    pending_input = None
    for block in fenced_blocks(text):
        label = _label(lines, block.line)
        if label == "input":
            if pending_input is not None:
                return ParseFailure("example without output")
            pending_input = block.body
        elif label == "output" and pending_input is not None:
            if not block.closed:
                return ParseFailure("example without output")
            pairs.append((_as_stream(pending_input), _as_stream(block.body)))
            pending_input = None
    if pending_input is not None:
        return ParseFailure("example without output")
    if not pairs:
        return ParseFailure("no examples")
    return tuple(pairs)


_LABEL = re.compile(r"\b(input|output)\b", re.IGNORECASE)


def _label(lines: list[str], fence_line: int) -> str | None:
    # The first of the two words: "Output for the input above" labels an output.
    above = next((line for line in reversed(lines[:fence_line]) if line.strip()), "")
    match = _LABEL.search(above)
    return match.group(1).lower() if match else None


def _as_stream(body: str) -> str:
    # As the seeds store them: stdin and stdout end with a newline unless empty.
    body = body.strip("\n")
    return f"{body}\n" if body else ""


_NEW_PROBLEM = re.compile(r"new[ \t]+problem[ \t]*\**[ \t]*:", re.IGNORECASE)
_PROBLEM_LABEL = re.compile(r"^\s*[#*]*\s*problem\s*\**\s*:", re.IGNORECASE)
# A line that starts the solution, or another example pair: the new problem ends there.
_AFTER_PROBLEM = re.compile(
    r"^[ \t#*]*(?:solution|answer|explanation|seed problem|problem)[ \t]*\**[ \t]*:",
    re.IGNORECASE | re.MULTILINE,
)


def parse_synthesized_math(completion: str, seed_problem: str) -> SynthesizedProblem | ParseFailure:
    labels = list(_NEW_PROBLEM.finditer(completion))
    if labels:
        text = completion[labels[-1].end() :]
    else:
        text = _PROBLEM_LABEL.sub("", completion, count=1)
    end = _AFTER_PROBLEM.search(text)
    text = text[: end.start() if end else len(text)].lstrip("* \t\r\n").rstrip()
    if not text:
        return ParseFailure("empty problem")
    if len(text) > MAX_STATEMENT_CHARS:
        return ParseFailure("too long")
    key = normalized_text_hash(text)
    if key == normalized_text_hash(seed_problem):
        return ParseFailure("copy of the seed")
    if key in _FORMAT_EXAMPLES:
        return ParseFailure("copy of the format example")
    return SynthesizedProblem(problem=text)
