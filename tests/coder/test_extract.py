from __future__ import annotations

import pytest

from rstar_pipelines.coder.extract import extract_final_answer, extract_program, fenced_blocks

FENCE = "```"


def test_takes_the_last_python_block():
    completion = f"""First attempt:
{FENCE}python
print(1)
{FENCE}
Better:
{FENCE}python
import sys
print(sum(map(int, sys.stdin.read().split())))
{FENCE}
"""
    assert extract_program(completion) == (
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n",
        None,
    )


@pytest.mark.parametrize("tag", ["python", "py", "python3", "Python", ""])
def test_accepts_python_tags_and_bare_fences(tag):
    assert extract_program(f"Code:\n{FENCE}{tag}\nprint(2)\n{FENCE}\n") == ("print(2)\n", None)


def test_skips_a_later_block_with_a_syntax_error():
    completion = f"{FENCE}python\nprint(1)\n{FENCE}\nOr:\n{FENCE}python\nprint(2\n{FENCE}\n"
    assert extract_program(completion) == ("print(1)\n", None)


def test_tagged_block_wins_over_a_later_bare_one():
    # The bare block is a sample output, and `6` alone is valid Python.
    completion = f"{FENCE}python\nprint(6)\n{FENCE}\nIt prints:\n{FENCE}\n6\n{FENCE}\n"
    assert extract_program(completion) == ("print(6)\n", None)


def test_bare_block_is_used_when_no_tagged_block_parses():
    completion = f"{FENCE}python\nprint(1\n{FENCE}\n{FENCE}\nprint(1)\n{FENCE}\n"
    assert extract_program(completion) == ("print(1)\n", None)


def test_other_languages_are_not_programs():
    assert extract_program(f"{FENCE}cpp\nint main() {{}}\n{FENCE}") == (None, "no code block")


def test_unterminated_last_fence_counts():
    assert extract_program(f"Here:\n{FENCE}python\nx = 1\nprint(x)\n") == (
        "x = 1\nprint(x)\n",
        None,
    )
    program, reason = extract_program(f"{FENCE}python\nfor i in range(3):\n")
    assert program is None
    assert reason.startswith("syntax error: ")


def test_indented_fence_is_dedented():
    completion = f"1. The code:\n   {FENCE}python\n   if True:\n       print(1)\n   {FENCE}\n"
    assert extract_program(completion) == ("if True:\n    print(1)\n", None)


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("print(1)", "no code block"),
        ("", "no code block"),
        (f"{FENCE}python\nprint(1\n{FENCE}", "syntax error: "),
        (f"{FENCE}python\nprint('a\0b')\n{FENCE}", "syntax error: "),
        (f"{FENCE}python\n\n{FENCE}", "empty program"),
        (f"{FENCE}python\n# TODO\n{FENCE}", "empty program"),
    ],
)
def test_no_program(completion, reason):
    program, why = extract_program(completion)
    assert program is None
    assert why.startswith(reason)


def test_syntax_error_names_the_error_and_line():
    _, reason = extract_program(f"{FENCE}python\nx = 1\nprint(x\n{FENCE}")
    assert reason.startswith("syntax error: ")
    assert "line 2" in reason  # of the program, not of the completion


def test_fenced_blocks_positions_and_closure():
    blocks = fenced_blocks(f"a\n{FENCE}py\nx\n{FENCE}\nb\n{FENCE}\ny")
    assert [(b.lang, b.body, b.closed, b.line) for b in blocks] == [
        ("py", "x", True, 1),
        ("", "y", False, 5),
    ]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("So the answer is \\boxed{42}.", ("42", None)),
        ("\\boxed{1} at first, finally \\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", None)),
        ("The answer is 42.", (None, "no \\boxed answer")),
        ("Cut off: \\boxed{4", (None, "no \\boxed answer")),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected
