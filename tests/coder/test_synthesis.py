from __future__ import annotations

import re

import pytest

from rstar_pipelines.coder.synthesis import (
    MAX_STATEMENT_CHARS,
    ParseFailure,
    SynthesizedProblem,
    normalized_text_hash,
    parse_synthesized_code,
    parse_synthesized_math,
)
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.settings import prompts_dir

FENCE = "```"

PROBLEM = "Count how many of the n given integers are divisible by k."
INPUT = "The first line contains n and k (1 <= n, k <= 100). The second line holds n integers."
OUTPUT = "Print one integer: the count."
EXAMPLES = f"""Input:
{FENCE}
3 2
1 2 4
{FENCE}
Output:
{FENCE}
2
{FENCE}
Input:
{FENCE}
1 5
3
{FENCE}
Output:
{FENCE}
0
{FENCE}
"""


def code_completion(
    problem: str | None = PROBLEM,
    input_format: str | None = INPUT,
    output_format: str | None = OUTPUT,
    examples: str | None = EXAMPLES,
    analysis: str = "Step 1: read the numbers.\nKnowledge Points: modular arithmetic.\n",
) -> str:
    parts = [analysis]
    for heading, body in (
        ("### Problem", problem),
        ("### Input", input_format),
        ("### Output", output_format),
        ("### Examples", examples),
    ):
        if body is not None:
            parts.append(f"{heading}\n{body}\n")
    return "\n".join(parts)


def test_well_formed_code_problem():
    parsed = parse_synthesized_code(code_completion())
    assert parsed == SynthesizedProblem(
        problem=f"{PROBLEM}\n\nInput\n{INPUT}\n\nOutput\n{OUTPUT}\n",
        examples=(("3 2\n1 2 4\n", "2\n"), ("1 5\n3\n", "0\n")),
    )


def test_code_problem_tolerates_heading_variants_and_keeps_the_last_problem():
    completion = f"""## Part 1: Analysis
### Problem Analysis
The seed sums numbers.

## Part 2
### New Problem: Divisible Count
{PROBLEM}

### Constraints
n is small.

### Input Format
{INPUT}

### **Output Format**
{OUTPUT}

### Example 1
**Input**
{FENCE}text
3 2
1 2 4
{FENCE}
**Output** for the input above
{FENCE}
2
{FENCE}
A bare block with no label is skipped:
{FENCE}
ignored
{FENCE}
"""
    parsed = parse_synthesized_code(completion)
    assert isinstance(parsed, SynthesizedProblem)
    assert parsed.problem.startswith(
        f"Divisible Count\n\n{PROBLEM}\n\n### Constraints\nn is small."
    )
    assert "\n\nInput\n" + INPUT in parsed.problem
    assert parsed.examples == (("3 2\n1 2 4\n", "2\n"),)


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("Here is a new problem: count numbers.", "no problem section"),
        (code_completion(problem=""), "empty problem"),
        (code_completion(input_format=None), "missing input format"),
        (code_completion(input_format="   "), "missing input format"),
        (code_completion(output_format=None), "missing output format"),
        (code_completion(examples=None), "no examples"),
        (code_completion(examples="Input: 3 2\nOutput: 2"), "no examples"),
        (code_completion(examples=f"Input:\n{FENCE}\n1\n{FENCE}\n"), "example without output"),
        (
            code_completion(examples=f"Input:\n{FENCE}\n1\n{FENCE}\nInput:\n{FENCE}\n2\n{FENCE}"),
            "example without output",
        ),
        # Cut off inside the output block.
        (
            code_completion(examples=f"Input:\n{FENCE}\n1\n{FENCE}\nOutput:\n{FENCE}\n1"),
            "example without output",
        ),
        (code_completion(problem="x" * MAX_STATEMENT_CHARS), "too long"),
    ],
)
def test_malformed_code_problem(completion, reason):
    assert parse_synthesized_code(completion) == ParseFailure(reason)


def test_code_synthesis_prompt_example_is_rejected_as_a_copy():
    # The rendered prompt holds the worked example; the 135M model echoes it, sometimes
    # with a new statement over the example's own examples.
    prompt = PromptTemplate.load(prompts_dir(), "synthesize_code.jinja").render(
        problem="Sum\n\nPrint the sum.", solution="print(1)"
    )
    copy = ParseFailure("copy of the format example")
    assert parse_synthesized_code(prompt) == copy
    reworded = prompt.replace("print the difference", "print the product")
    assert parse_synthesized_code(reworded) == copy
    assert isinstance(
        parse_synthesized_code(reworded.replace("4 -2 7", "4 -2 8")), SynthesizedProblem
    )


SEED = "A baker fills 14 trays with 18 cookies each and sells 197. How many are left?"
NEW = "A farmer plants 12 rows of 9 trees and 15 trees die. How many trees are alive?"


@pytest.mark.parametrize(
    "completion",
    [
        f"New problem: {NEW}",
        f"Let me think.\nNew Problem:\n{NEW}\n",
        f"**New problem:** {NEW}",
        f"New problem: draft\nNew problem: {NEW}",
        f"New problem: {NEW}\nSolution: 12 * 9 - 15 = 93.",
        f"New problem: {NEW}\n\nProblem: Another one?",
        f" {NEW}\n",
        f"Problem: {NEW}",
        f"{NEW}\n**Answer:** 93",
    ],
)
def test_well_formed_math_problem(completion):
    assert parse_synthesized_math(completion, SEED) == SynthesizedProblem(problem=NEW)


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("New problem:", "empty problem"),
        ("   \n", "empty problem"),
        ("New problem:\nSolution: 42", "empty problem"),
        (f"New problem: {'many apples ' * 400}", "too long"),
        (f"New problem: {SEED.upper()}", "copy of the seed"),
        (f"New problem: {SEED.replace(' ', '  ').replace('?', '')}", "copy of the seed"),
    ],
)
def test_malformed_math_problem(completion, reason):
    assert parse_synthesized_math(completion, SEED) == ParseFailure(reason)


def test_math_synthesis_prompt_example_is_rejected_as_a_copy():
    source = PromptTemplate.load(prompts_dir(), "synthesize_math.jinja").source
    example = re.search(r"^New problem: .+$", source, re.MULTILINE).group(0)
    assert parse_synthesized_math(example, SEED) == ParseFailure("copy of the format example")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How many apples are left?", "how  many apples are\nleft"),
        ("Tom's cat, Fluffy, sleeps.", "tom s cat fluffy sleeps"),
        ("“Quoted” text…", '"quoted" text...'),
        ("\uff26\uff55\uff4c\uff4c width", "full width"),
    ],
)
def test_hash_collides_on_case_spacing_punctuation(a, b):
    assert normalized_text_hash(a) == normalized_text_hash(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("There are 35 apples.", "There are 3.5 apples."),
        ("Solve x-1 = 0.", "Solve x 1 = 0."),
        ("It is -5 degrees.", "It is 5 degrees."),
        ("Eat 3/8 of it.", "Eat 38 of it."),
        ("The sum of 12, 3", "The sum of 1, 23"),
        ("How many apples?", "How many pears?"),
    ],
)
def test_hash_keeps_different_problems_apart(a, b):
    assert normalized_text_hash(a) != normalized_text_hash(b)


def test_hash_shape():
    key = normalized_text_hash("anything")
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert key == normalized_text_hash("anything")


TEMPLATES = {
    "synthesize_code.jinja": {"problem": "P", "solution": "S"},
    "synthesize_math.jinja": {"problem": "P"},
    "solve_code.jinja": {"problem": "P"},
    "solve_math.jinja": {"problem": "P"},
}


@pytest.mark.parametrize(("name", "variables"), TEMPLATES.items())
def test_template_renders_with_its_variables(name, variables):
    markers = {var: f"<<{var.upper()}>>" for var in variables}
    text = PromptTemplate.load(prompts_dir(), name).render(**markers)
    for marker in markers.values():
        assert marker in text


@pytest.mark.parametrize(("name", "variables"), TEMPLATES.items())
def test_template_fails_on_a_missing_variable(name, variables):
    template = PromptTemplate.load(prompts_dir(), name)
    for missing in variables:
        with pytest.raises(ValueError, match=missing):
            template.render(**{k: v for k, v in variables.items() if k != missing})


@pytest.mark.parametrize(
    ("name", "format_marker"),
    [
        ("synthesize_code.jinja", "### Examples"),
        ("synthesize_math.jinja", "New problem:"),
        ("solve_code.jinja", "```python"),
        ("solve_math.jinja", "\\boxed{"),
    ],
)
def test_template_states_its_output_format(name, format_marker):
    assert format_marker in PromptTemplate.load(prompts_dir(), name).source


def test_example_labels_may_be_headings():
    examples = f"#### Input\n{FENCE}\n1 1\n5\n{FENCE}\n#### Output\n{FENCE}\n1\n{FENCE}\n"
    parsed = parse_synthesized_code(code_completion(examples=examples))
    assert isinstance(parsed, SynthesizedProblem)
    assert parsed.problem == f"{PROBLEM}\n\nInput\n{INPUT}\n\nOutput\n{OUTPUT}\n"
    assert parsed.examples == (("1 1\n5\n", "1\n"),)
