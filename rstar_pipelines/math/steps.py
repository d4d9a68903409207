"""The code-augmented chain-of-thought format of rStar-Math, and running its steps.

A solution is one `<code>` block whose steps are Python with the reasoning in `#`
comments, each step closed by `<end_of_step>`; the last code step prints the answer and
closes the block with `<end_of_code>`; the interpreter output follows as
`<output>...<end_of_output>`, then an `<answer>...\\boxed{...}...<end_of_answer>` step.
Every code step is checked by running the whole program so far, from scratch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rstar_pipelines.math.answers import extract_boxed

CODE_START = "<code>"
STEP_END = "<end_of_step>"
CODE_END = "<end_of_code>"
OUTPUT_START = "<output>"
OUTPUT_END = "<end_of_output>"
ANSWER_START = "<answer>"
ANSWER_END = "<end_of_answer>"
# Added to tokenizers as special tokens when a policy or a PPM is trained.
TAGS = (CODE_START, STEP_END, CODE_END, OUTPUT_START, OUTPUT_END, ANSWER_START, ANSWER_END)

# Stop strings: the bootstrap round also stops at <end_of_output>; later rounds do not.
BOOTSTRAP_STOPS = (STEP_END, CODE_END, OUTPUT_END, ANSWER_END)
LATER_STOPS = (STEP_END, CODE_END, ANSWER_END)

# How the assistant turn of a trained policy starts (the SFT format of the reference).
PREAMBLE = "Let's think step by step and solve the problem with code.\n"

# Final answers of failure terminals (the reference's sentinels).
NO_VALID_CHILD = "NO_VALID_CHILD"
TOO_MANY_STEPS = "TOO_MANY_STEPS"
TOO_MANY_CODE_ERRORS = "TOO_MANY_CODE_ERRORS"
FAILURES = frozenset({NO_VALID_CHILD, TOO_MANY_STEPS, TOO_MANY_CODE_ERRORS})

MAX_OBSERVATION_CHARS = 1024


@dataclass(frozen=True)
class ParsedStep:
    """A generated step: its text with the stop string put back, and what it is: "answer",
    "code" (a Python action, run), or "text" (neither: a `boxed` step with no answer in it)."""

    text: str
    kind: str
    final_answer: str | None
    closes_code: bool


def parse_step(
    text: str, stop_string: str | None, empty_box: str = "step", answers: str = "reference"
) -> ParsedStep:
    """A step as the reference reads it: any `boxed` makes it an answer step; anything else is
    a Python action. The answer is read by the reference's rule (`reference_answer`), or with
    `answers="last_box"` as math-verify reads boxes (`extract_boxed`). A `boxed` step from
    which no answer is read (an empty box) is, with `empty_box="step"` as in the reference, an
    ordinary step that runs no code; with "wrong_answer", an answer step without an answer."""
    full = text + (stop_string or "")
    if "boxed" in full:
        answer = reference_answer(full) if answers == "reference" else extract_boxed(full)
        if not answer:
            if empty_box == "step":
                return ParsedStep(full, "text", None, False)
            answer = None
        return ParsedStep(full, "answer", answer, False)
    return ParsedStep(full, "code", None, CODE_END in full)


INVALID_ANSWER = "[invalid]"


def reference_answer(text: str) -> str:
    """The final answer of an answer step by the reference's rule: the text before its first
    ".\n", less a final period; in it, the content of the last `\boxed{` (the rest of the text
    when the box is not closed; the whole text when there is none); then the first `\text{...}`
    unwrapped (dropped when it holds only "and"). "" when the box is empty; "[invalid]" when the
    braces cannot be matched."""
    try:
        head = text.split(".\n")[0].strip()
        if head.endswith("."):
            head = head[:-1]
        return _unwrap_text(_last_box(head.strip()))
    except (IndexError, UnboundLocalError):
        return INVALID_ANSWER


def _last_box(text: str) -> str:
    start = text.rfind("\\boxed{")
    if start == -1:
        return text
    rest, opened, end = text[start:], [], None
    for i, char in enumerate(rest):
        if char == "{":
            opened.append(i)
        elif char == "}":
            start = opened.pop()
            if not opened:
                end = i
                break
    # As the reference: unclosed, the cut starts after the last brace it matched (or at the
    # position of the box in the whole text, when it matched none).
    return rest[start + 1 : end]


def _unwrap_text(text: str) -> str:
    start = text.find("\\text{")
    if start == -1:
        return text
    rest, opened = text[start:], []
    for i, char in enumerate(rest):
        if char == "{":
            opened.append(i)
        elif char == "}":
            inner = opened.pop()
            if not opened:
                close = i
                break
    inside = text[start + inner + 1 : start + close]
    if inside.strip() == "and":
        return (text[:start] + text[start + close + 1 :]).strip()
    return (text[:start] + inside.strip() + text[start + close + 1 :]).strip()


def program_of(actions: Sequence[str]) -> str:
    """The program the steps of one code block add up to: the text between the
    `<code>` line and `<end_of_code>`, step markers removed."""
    joined = "".join(actions).replace(STEP_END, "")
    if CODE_START in joined:
        joined = joined.split(CODE_START, 1)[1]
    joined = joined.split(CODE_END, 1)[0]
    return _print_last_expression(joined.strip("\n") + "\n")


def _print_last_expression(code: str) -> str:
    """Show a trailing bare expression's value, as the reference's interpreter does."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # running it reports the syntax error
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    call = last.value
    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print":
        return code
    lines = code.splitlines(keepends=True)
    start, end = last.lineno - 1, last.end_lineno or last.lineno
    expression = ast.get_source_segment(code, last.value) or ""
    return "".join(lines[:start]) + f"print({expression})\n" + "".join(lines[end:])


_NUMBER = re.compile(r"^-?\d+\.\d+$")


def observation_of(status: str, stdout: str, stderr: str) -> str:
    """What the model sees of a run: its output, or `ExcType: message` when it failed,
    numbers rounded to 4 decimals and long output cut in the middle."""
    if status == "ok":
        text = stdout.strip()
    elif status == "timeout":
        text = "TimeoutError: execution timed out"
    elif status == "memory_limit":
        text = "MemoryError: memory limit exceeded"
    elif status == "output_limit":
        text = "OverflowError: output limit exceeded"
    else:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        text = lines[-1].strip() if lines else f"RuntimeError: {status}"
    lines = [_rounded(line) for line in text.split("\n")]
    text = "\n".join(lines)
    if len(text) > MAX_OBSERVATION_CHARS:
        half = MAX_OBSERVATION_CHARS // 2
        text = text[:half] + "..." + text[-half:]
    return text


def _rounded(line: str) -> str:
    if _NUMBER.match(line.strip()):
        shorter = f"{float(line):.4f}".rstrip("0").rstrip(".")
        if len(shorter) < len(line.strip()):
            return shorter
    return line


def is_error(observation: str, status: str, rule: str) -> bool:
    """Did a step fail? Rule "substring" (the reference): the word "error" appears in
    the observation, whatever printed it. Rule "status": the run did not end ok."""
    if rule == "substring":
        return "error" in observation.lower()
    if rule == "status":
        return status != "ok"
    raise ValueError(f"unknown error rule {rule!r}: expected 'substring' or 'status'")


def with_output(step_text: str, observation: str) -> str:
    """A code step that closes the block shows the interpreter's output after it."""
    return f"{step_text}\n{OUTPUT_START}{observation}{OUTPUT_END}"


def assistant_text(step_texts: Sequence[str]) -> str:
    """The assistant turn of a trained policy for a (partial) trajectory: the preamble
    and the steps so far. The same text is what a PPM scores."""
    return PREAMBLE + "".join(step_texts)
