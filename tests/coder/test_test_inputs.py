from __future__ import annotations

import os
from pathlib import Path

import pytest

from rstar_pipelines.coder.test_inputs import (
    DEFAULT_GRID,
    InputProgram,
    generate_inputs,
    parse_input_program,
    scale_points,
)
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_sandbox import Sandbox

PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "prompts"

SUM_PROGRAM = """\
import random


def generate_test_input(n):
    if not 1 <= n <= 10**5:
        return None
    a = [random.randint(-(10**9), 10**9) for _ in range(n)]
    return f"{n}\\n{' '.join(map(str, a))}\\n"


def validate_test_input(input_string):
    lines = input_string.strip().split("\\n")
    try:
        n = int(lines[0])
        a = [int(x) for x in lines[1].split()]
    except (IndexError, ValueError):
        return False
    return len(lines) == 2 and 1 <= n <= 10**5 and len(a) == n and all(abs(x) <= 10**9 for x in a)
"""
SUM_SCALES = "SCALES = {'n': [1, 10, 100, 1000, 10000, 100000]}\n"
EXAMPLES = ["3\n1 2 3\n", "1\n-5\n"]


def _n(text: str) -> int:
    return int(text.split("\n", 1)[0])


@pytest.fixture(scope="module")
def sandbox():
    if os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"):
        pytest.skip("the process backend needs root or user namespaces")
    with Sandbox(backend="process", workers=2) as sb:
        yield sb


# -- parsing ---------------------------------------------------------------------------


def test_parse_takes_the_last_block_with_both_functions():
    draft = "def generate_test_input(n):\n    return '1'\n\ndef validate_test_input(s):\n"
    draft += "    return True\n"
    text = (
        "Constraints: 1 <= n <= 10^5.\n\nA first try:\n```python\n" + draft + "```\n"
        "Better:\n```py\n" + SUM_PROGRAM + SUM_SCALES + "```\n"
        "For example it prints:\n```\n3\n1 2 3\n```\nDone."
    )
    program = parse_input_program(text)
    assert program.error is None
    assert program.source == SUM_PROGRAM + SUM_SCALES
    assert program.scales == {"n": [1, 10, 100, 1000, 10000, 100000]}


@pytest.mark.parametrize(
    "scales_line",
    ["", "SCALES = {'n': [1, -10]}\n", "SCALES = {'m': [1, 10]}\n", "SCALES = make()\n"],
)
def test_missing_or_invalid_scales_default_to_the_first_parameter(scales_line):
    source = SUM_PROGRAM.replace("(n)", "(n, k=3)") + scales_line
    program = parse_input_program(f"```python\n{source}```")
    assert program.error is None
    assert program.scales == {"n": DEFAULT_GRID}


def test_scales_for_several_parameters_and_for_none():
    source = (
        "def generate_test_input(*, n, m):\n    return f'{n} {m}'\n"
        "def validate_test_input(s):\n    return True\n"
        "SCALES = {'n': [1, 100], 'm': [1, 10, 100]}\n"
    )
    assert parse_input_program(f"```\n{source}```").scales == {"n": [1, 100], "m": [1, 10, 100]}
    fixed = (
        "def generate_test_input():\n    return '1'\ndef validate_test_input(s):\n    return 1\n"
    )
    assert parse_input_program(f"```python\n{fixed}```").scales == {}


def test_syntax_error_is_reported():
    program = parse_input_program("```python\ndef generate_test_input(n:\n    return 1\n```")
    assert program.source == ""
    assert program.error.startswith("syntax error")


def test_missing_code_block_or_function_is_reported():
    assert "no ```python code block" in parse_input_program("Here it is: n = 5").error
    program = parse_input_program("```python\ndef generate_test_input(n):\n    return 'x'\n```")
    assert "validate_test_input" in program.error
    assert program.source == ""


# -- scale points ----------------------------------------------------------------------


def test_scale_points_advance_parameters_together():
    scales = {"n": [1, 10, 100, 1000], "m": [1, 1000]}
    assert scale_points(scales, 4) == [
        {"n": 1, "m": 1},
        {"n": 10, "m": 1},
        {"n": 100, "m": 1000},
        {"n": 1000, "m": 1000},
    ]


def test_scale_points_repeat_or_thin_the_grid():
    scales = {"n": [1, 10, 100]}
    assert [p["n"] for p in scale_points(scales, 7)] == [1, 1, 1, 10, 10, 100, 100]
    assert [p["n"] for p in scale_points({"n": DEFAULT_GRID}, 3)] == [1, 50, 100000]
    assert scale_points(scales, 1) == [{"n": 1}]
    assert scale_points({}, 2) == [{}, {}]


# -- generation in the sandbox ---------------------------------------------------------


def test_generates_unique_valid_inputs_up_to_the_largest_scale(sandbox):
    program = parse_input_program(f"```python\n{SUM_PROGRAM}{SUM_SCALES}```")
    gen = generate_inputs(program, sandbox, examples=EXAMPLES, target=50, seed=0)
    assert gen.inputs[:2] == EXAMPLES
    assert gen.kept == len(gen.inputs) == len(set(gen.inputs)) >= 50
    assert gen.generated == gen.valid >= 75
    assert gen.errors == []
    assert gen.largest_ok_scale == {"n": 100000}
    assert {_n(text) for text in gen.inputs[2:]} == {1, 10, 100, 1000, 10000, 100000}
    assert any(len(text.split()) == 100001 for text in gen.inputs)
    again = generate_inputs(program, sandbox, examples=EXAMPLES, target=50, seed=0)
    assert again.inputs == gen.inputs


def test_a_generator_failing_at_large_scales_keeps_the_small_inputs(sandbox):
    source = SUM_PROGRAM.replace(
        "    if not 1 <= n",
        "    if n > 1000:\n        raise ValueError('too big')\n    if not 1 <= n",
    )
    # Stray output of the program must not disturb the driver's result line.
    source += "print('debug')\nif __name__ == '__main__':\n    print(generate_test_input(n=3))\n"
    program = parse_input_program(f"```python\n{source}{SUM_SCALES}```")
    gen = generate_inputs(program, sandbox, examples=["1\n1\n"], target=20)
    assert gen.largest_ok_scale == {"n": 1000}
    assert gen.inputs[0] == "1\n1\n"
    assert {_n(text) for text in gen.inputs[1:]} == {1, 10, 100, 1000}
    assert gen.valid == gen.generated == 20  # 30 jobs, 5 at each of the 6 scales
    assert 0 < len(gen.errors) <= 5
    assert gen.errors[0].scale == {"n": 10000}
    assert gen.errors[0].status == "runtime_error"
    assert gen.errors[0].message == "ValueError: too big"


def test_inputs_the_validator_rejects_are_dropped(sandbox):
    # Odd n is rejected; above 1000 the generator declines (returns None).
    source = SUM_PROGRAM.replace("10**5:\n        return None", "1000:\n        return None")
    source = source.replace("    return len(lines)", "    return n % 2 == 0 and len(lines)")
    program = InputProgram(source, {"n": [1, 2, 5, 10, 50, 100, 1000, 10000]})
    gen = generate_inputs(program, sandbox, examples=["3\n1 2 3\n"], target=10)
    points = scale_points(program.scales, 15)
    assert gen.generated == sum(p["n"] <= 1000 for p in points)
    assert gen.valid == sum(p["n"] <= 1000 and p["n"] % 2 == 0 for p in points) < gen.generated
    assert gen.inputs[0] == "3\n1 2 3\n"  # examples are not validated
    assert {_n(text) for text in gen.inputs[1:]} == {2, 10, 50, 100, 1000}
    assert gen.errors == []
    assert gen.largest_ok_scale == {"n": 1000}


def test_a_program_that_failed_to_parse_yields_only_the_examples(sandbox):
    program = parse_input_program("no code here")
    gen = generate_inputs(program, sandbox, examples=["1\n", "1\n", "2\n"])
    assert gen.inputs == ["1\n", "2\n"]
    assert (gen.generated, gen.valid, gen.kept) == (0, 0, 2)
    assert gen.errors[0].message == program.error


# -- prompt ----------------------------------------------------------------------------


def test_the_prompt_renders_with_a_problem():
    template = PromptTemplate.load(PROMPTS, "test_input_program.jinja")
    prompt = template.render(problem="Given a string s (1 <= |s| <= 10^5), print it reversed.")
    assert "print it reversed" in prompt
    for name in ("generate_test_input", "validate_test_input", "SCALES"):
        assert name in prompt
    with pytest.raises(ValueError, match="'problem' is undefined"):
        template.render()
