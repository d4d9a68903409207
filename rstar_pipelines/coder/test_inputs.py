"""Test inputs for a programming problem, the rStar-Coder way (docs/rstar-coder.md).

An LLM writes `generate_test_input(**scale)`, `validate_test_input(input_string)` and a
`SCALES` grid of its size parameters (prompt: assets/prompts/test_input_program.jinja);
the sandbox runs the generator over the grid, small to large, and the validator on every
input; the valid inputs, deduplicated, join the problem's examples.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from rstar_sandbox import OK, Job, Result, Sandbox

__all__ = [
    "DEFAULT_GRID",
    "InputError",
    "InputGeneration",
    "InputProgram",
    "generate_inputs",
    "parse_input_program",
    "scale_points",
]

GENERATOR = "generate_test_input"
VALIDATOR = "validate_test_input"
DEFAULT_GRID = [1, 2, 5, 10, 50, 100, 1000, 10000, 100000]
OUTPUT_LIMIT_BYTES = 16 << 20  # a 10^5-number input is ~1 MB; leave room for bigger ones
MAX_ERRORS = 5

_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"", "python", "python3", "py"}

# Runs in the sandbox. The program and the job's scale and seed arrive on stdin, so the
# code is the same for every job. The program is exec'd under a name other than
# __main__ so its own demo blocks stay quiet, and anything it prints goes to stderr so
# that stdout holds only the result line.
_DRIVER = """\
import contextlib, json, random, sys

job = json.loads(sys.stdin.read())
program = {"__name__": "test_input_program"}
with contextlib.redirect_stdout(sys.stderr):
    exec(compile(job["source"], "<test_input_program>", "exec"), program)
    random.seed(job["seed"])
    text = program["generate_test_input"](**job["scale"])
    if text is None:
        sys.exit(0)
    text = str(text)
    try:
        valid = bool(program["validate_test_input"](text))
    except Exception:
        valid = False
print(json.dumps({"input": text, "valid": valid}))
"""


@dataclass(frozen=True)
class InputProgram:
    """The generator/validator program from one completion; `error` says why there is
    none (then `source` is "")."""

    source: str
    scales: dict[str, list[int]] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class InputError:
    """A generator job that produced nothing: its scale, sandbox status, last stderr line."""

    scale: dict[str, int]
    status: str
    message: str


@dataclass(frozen=True)
class InputGeneration:
    inputs: list[str]
    generated: int
    valid: int
    kept: int
    errors: list[InputError]
    largest_ok_scale: dict[str, int] | None


def parse_input_program(text: str) -> InputProgram:
    """The last Python code block of `text` that defines both functions, with its SCALES."""
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    if not blocks:
        return InputProgram("", error="no ```python code block in the completion")
    syntax_error = None
    for body in reversed(blocks):
        try:
            tree = ast.parse(body, "<program>")
        except SyntaxError as err:
            syntax_error = syntax_error or f"syntax error: {err}"
            continue
        functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        if GENERATOR in functions and VALIDATOR in functions:
            return InputProgram(body, _scales(tree, functions[GENERATOR]))
    if syntax_error:
        return InputProgram("", error=syntax_error)
    return InputProgram("", error=f"no code block defines both {GENERATOR} and {VALIDATOR}")


def _scales(tree: ast.Module, generator: ast.FunctionDef) -> dict[str, list[int]]:
    args = generator.args
    params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if not params:
        return {}
    declared = _declared_scales(tree)
    if declared and (args.kwarg or set(declared) <= set(params)):
        return declared
    return {params[0]: list(DEFAULT_GRID)}


def _declared_scales(tree: ast.Module) -> dict[str, list[int]] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "SCALES" for t in targets):
            continue
        try:
            scales = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        ok = isinstance(scales, dict) and all(
            isinstance(name, str)
            and isinstance(values, list)
            and values
            and all(type(v) is int and v >= 0 for v in values)
            for name, values in scales.items()
        )
        return scales if ok else None
    return None


def scale_points(scales: dict[str, list[int]], count: int) -> list[dict[str, int]]:
    """`count` scale points from small to large. The parameters advance together (a
    shorter list is stretched over the longest one); more points than grid values
    repeat each value evenly, fewer pick evenly spaced values from both ends."""
    if not scales:
        return [{} for _ in range(count)]
    length = max(len(values) for values in scales.values())
    if count >= length:
        positions = [j * length // count for j in range(count)]
    elif count == 1:
        positions = [0]
    else:
        positions = [round(j * (length - 1) / (count - 1)) for j in range(count)]
    return [
        {
            name: values[round(p * (len(values) - 1) / (length - 1)) if length > 1 else 0]
            for name, values in scales.items()
        }
        for p in positions
    ]


def generate_inputs(
    program: InputProgram,
    sandbox: Sandbox,
    examples: Sequence[str] = (),
    *,
    target: int = 50,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    seed: int = 0,
) -> InputGeneration:
    """Run the program over its scale grid (about 1.5 x `target` jobs, so that enough
    survive validation and deduplication) and keep the unique valid inputs after the
    examples, which are kept as they are."""
    inputs = list(dict.fromkeys(examples))
    if program.error:
        error = InputError({}, "invalid_program", program.error)
        return InputGeneration(inputs, 0, 0, len(inputs), [error], None)

    grid = max((len(values) for values in program.scales.values()), default=1)
    points = scale_points(program.scales, max(grid, math.ceil(1.5 * target)))
    rng = random.Random(seed)
    jobs = [
        Job(
            code=_DRIVER,
            stdin=json.dumps(
                {"source": program.source, "scale": point, "seed": rng.getrandbits(63)}
            ),
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            output_limit_bytes=OUTPUT_LIMIT_BYTES,
        )
        for point in points
    ]

    seen = set(inputs)
    generated = valid = 0
    errors: list[InputError] = []
    largest_ok_scale = None
    for point, result in zip(points, sandbox.run(jobs), strict=True):
        outcome = _outcome(result)
        if isinstance(outcome, str):
            if len(errors) < MAX_ERRORS:
                errors.append(InputError(point, result.status, outcome))
            continue
        if outcome is None:  # the generator declined this scale
            continue
        generated += 1
        if not outcome["valid"]:
            continue
        valid += 1
        largest_ok_scale = point  # jobs run small to large
        if outcome["input"] not in seen:
            seen.add(outcome["input"])
            inputs.append(outcome["input"])
    return InputGeneration(inputs, generated, valid, len(inputs), errors, largest_ok_scale)


def _outcome(result: Result) -> dict | str | None:
    """The job's {"input", "valid"} line, None if it printed none, or an error message."""
    if result.status != OK:
        lines = result.stderr.strip().splitlines()
        return lines[-1][:300] if lines else f"exit code {result.exit_code}"
    lines = result.stdout.strip().splitlines()
    if not lines:
        return None
    try:
        outcome = json.loads(lines[-1])
        return {"input": str(outcome["input"]), "valid": outcome["valid"] is True}
    except (ValueError, KeyError, TypeError):
        return f"unreadable driver output: {lines[-1][:300]!r}"
