"""The agent's text format: tool-call parsing, tool responses, answers and the prompt templates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rstar_pipelines.agent.format import (
    ParsedCall,
    agent_prompt,
    answer_block,
    final_answer,
    parse_tool_calls,
    render_result,
    render_tool_responses,
    truncate_middle,
)
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_sandbox import Result

PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "prompts"


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def test_parses_every_closed_block_in_order():
    text = (
        "First the sum.\n"
        + block('{"name": "python", "arguments": {"code": "print(1 + 2)"}}')
        + "\nthen the product\n"
        + block(
            '{"name": "python", "arguments": {"code": "print(int(input()) * 2)", "input": "21"}}'
        )
        + '\n<tool_call>\n{"name": "python", "arguments": {"code": "print(3)"}}'
    )
    # The last block is never closed: plain text, as in the reference parser.
    assert parse_tool_calls(text) == [
        ParsedCall(code="print(1 + 2)"),
        ParsedCall(code="print(int(input()) * 2)", stdin="21"),
    ]
    assert parse_tool_calls("The answer is <answer>\\boxed{3}</answer>") == []


def test_malformed_json_is_an_error_with_the_decoder_message():
    payload = '{"name": "python", "arguments": {"code": "print(1)"}'  # one brace short
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(f"\n{payload}\n")  # the block's text, newlines included
    [call] = parse_tool_calls(block(payload))
    assert call == ParsedCall(error=f"Failed to decode tool call: {err.value}")
    assert "Expecting" in call.error


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ('["python", "print(1)"]', 'expected a JSON object with "name" and "arguments"'),
        ('{"name": "bash", "arguments": {"code": "ls"}}', "unknown tool 'bash'"),
        ('{"arguments": {"code": "print(1)"}}', "unknown tool None"),
        ('{"name": "python", "arguments": "print(1)"}', '"arguments" must be a JSON object'),
        ('{"name": "python", "arguments": {"input": "3"}}', '"code" must be a non-empty string'),
        ('{"name": "python", "arguments": {"code": "  "}}', '"code" must be a non-empty string'),
        ('{"name": "python", "arguments": {"code": "x", "input": 3}}', '"input" must be a string'),
        (
            '{"name": "python", "arguments": {"code": "x", "stdin": "3"}}',
            "unknown arguments ['stdin']",
        ),
    ],
)
def test_invalid_calls_are_errors_that_say_why(payload, why):
    [call] = parse_tool_calls(block(payload))
    assert call.error is not None and call.code == "" and call.stdin == ""
    assert call.error.startswith("Failed to decode tool call: ")
    assert why in call.error


def result(status: str, stdout: str = "", stderr: str = "") -> Result:
    return Result(status, 0 if status == "ok" else 1, stdout, stderr, 0.01, 0.01, 20.0)


def test_render_result_like_the_reference():
    assert render_result(result("ok", "42\n")) == "Tool call success\nstdout: 42"
    assert render_result(result("ok")) == "Tool call success"
    assert render_result(result("runtime_error", "partial\n", "ZeroDivisionError\n")) == (
        "Tool call failure\nreason: runtime_error\nstdout: partial\nstderr: ZeroDivisionError"
    )
    assert render_result(result("timeout")) == "Tool call failure\nreason: timeout"


def test_truncate_middle_keeps_limit_characters_and_says_how_many_were_cut():
    assert truncate_middle("abcdefghij", 10) == "abcdefghij"
    # 4 of 10 kept: 2 from the head, 2 from the tail; 6 cut.
    assert truncate_middle("abcdefghij", 4) == "ab\n...[6 characters cut]...\nij"
    # An odd limit gives the extra character to the tail.
    assert truncate_middle("abcdefghij", 3) == "a\n...[7 characters cut]...\nij"
    with pytest.raises(ValueError, match="at least 1"):
        truncate_middle("abc", 0)


def test_responses_of_one_turn_share_one_user_message():
    assert render_tool_responses(["Tool call success\nstdout: 1", "Failed to decode"]) == (
        "<tool_response>\nTool call success\nstdout: 1\n</tool_response>\n"
        "<tool_response>\nFailed to decode\n</tool_response>"
    )
    with pytest.raises(ValueError):
        render_tool_responses([])


def test_answer_block_and_final_answer():
    assert answer_block("no answer") is None
    assert answer_block("<answer>a</answer> then <answer>\n b \n</answer>") == "b"
    assert answer_block("<answer>never closed") is None
    # The last answer block's box...
    text = "\\boxed{1} <answer>first</answer> <answer>so \\boxed{\\frac{1}{2}}.</answer> \\boxed{9}"
    assert final_answer(text) == "\\frac{1}{2}"
    # ... else the block itself ...
    assert final_answer("<answer> 0.5 </answer>") == "0.5"
    # ... else the last box anywhere (an unclosed block is no block) ...
    assert final_answer("x \\boxed{3} then <answer>\\boxed{4}") == "4"
    # ... else nothing.
    assert final_answer("I give up.") is None
    assert final_answer("<answer></answer>") is None


def test_templates_render_a_prompt_whose_tool_schema_and_example_call_are_valid():
    system = PromptTemplate.load(PROMPTS, "agent_system.jinja")
    user = PromptTemplate.load(PROMPTS, "agent_user.jinja")
    math = agent_prompt(system, user, "  What is 2 + 3?\n", "math")
    code = agent_prompt(system, user, "Read n and print n * 2.", "code")
    assert [m["role"] for m in math] == ["system", "user"]
    assert math[0] == code[0]  # one system prompt for both domains
    assert math[1]["content"].endswith("This is the problem:\nWhat is 2 + 3?\n")
    assert "\\boxed{}" in math[1]["content"] and "```python" not in math[1]["content"]
    assert "```python" in code[1]["content"] and "\\boxed" not in code[1]["content"]

    prompt = math[0]["content"]
    schema = json.loads(re.search(r"<tools>\n(.*)\n</tools>", prompt).group(1))
    assert schema["name"] == "python"
    assert set(schema["parameters"]["properties"]) == {"code", "input"}
    # The example the prompt shows is a call the parser accepts.
    assert parse_tool_calls(prompt) == [ParsedCall(code="print(sum(range(1, 11)))")]
    assert "<answer>" in prompt and "<tool_response>" in prompt

    with pytest.raises(ValueError, match="domain"):
        agent_prompt(system, user, "q", "physics")
