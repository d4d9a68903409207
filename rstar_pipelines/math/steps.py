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
    """A generated step: its text with the stop string put back, and what it is."""

    text: str
    is_answer: bool
    final_answer: str | None
    closes_code: bool


def parse_step(text: str, stop_string: str | None) -> ParsedStep:
    """A step as the reference reads it: any `boxed` makes it an answer step (its
    final answer is the last box's content); anything else is a Python action."""
    full = text + (stop_string or "")
    if "boxed" in full:
        return ParsedStep(full, True, extract_boxed(full), False)
    return ParsedStep(full, False, None, CODE_END in full)


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
