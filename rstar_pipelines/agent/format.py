"""The agent's text format: tool calls, tool responses, answers (rStar2-Agent, docs/agent.md).

An assistant turn calls the one tool, `python` (a stateless run of `code` with `input` on stdin,
the reference's `python_code_with_standard_io`), with blocks like

    <tool_call>
    {"name": "python", "arguments": {"code": "print(int(input()) * 2)", "input": "21"}}
    </tool_call>

and the results come back in one user turn, one `<tool_response>` block per call. Only closed
blocks are calls, as in the reference parser: an unclosed `<tool_call>` is plain text. A block
that is not a valid call is answered with "Failed to decode tool call: <why>" instead of running,
so the model sees its mistake (the reference's rstar2_agent_hermes parser does the same).

Tool responses are middle-truncated to a declared number of characters: the head keeps the
success/failure line, the tail the end of stderr (the exception), which matter most.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rstar_sandbox import Result

if TYPE_CHECKING:
    from rstar_pipelines.pipeline.prompts import PromptTemplate

__all__ = [
    "DECODE_ERROR",
    "TOOL_NAME",
    "ParsedCall",
    "agent_prompt",
    "answer_block",
    "final_answer",
    "parse_tool_calls",
    "render_result",
    "render_tool_responses",
    "truncate_middle",
]

TOOL_NAME = "python"
DECODE_ERROR = "Failed to decode tool call: "
_ARGUMENTS = frozenset({"code", "input"})
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """One `<tool_call>` block: the program and its stdin, or why it cannot run (`error`, the
    full text the model gets back)."""

    code: str = ""
    stdin: str = ""
    error: str | None = None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every closed `<tool_call>` block of an assistant turn, in order."""
    return [_parse_call(block) for block in _TOOL_CALL.findall(text)]


def _parse_call(block: str) -> ParsedCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as err:
        return ParsedCall(error=DECODE_ERROR + str(err))
    if not isinstance(call, dict):
        return ParsedCall(error=DECODE_ERROR + 'expected a JSON object with "name" and "arguments"')
    name, arguments = call.get("name"), call.get("arguments")
    if name != TOOL_NAME:
        return ParsedCall(error=DECODE_ERROR + f"unknown tool {name!r}, the only tool is 'python'")
    if not isinstance(arguments, dict):
        return ParsedCall(error=DECODE_ERROR + '"arguments" must be a JSON object')
    unknown = sorted(set(arguments) - _ARGUMENTS)
    if unknown:
        return ParsedCall(
            error=DECODE_ERROR + f"unknown arguments {unknown}, python takes code and input"
        )
    code, stdin = arguments.get("code"), arguments.get("input", "")
    if not isinstance(code, str) or not code.strip():
        return ParsedCall(error=DECODE_ERROR + '"code" must be a non-empty string')
    if not isinstance(stdin, str):
        return ParsedCall(error=DECODE_ERROR + '"input" must be a string')
    return ParsedCall(code=code, stdin=stdin)


def render_result(result: Result) -> str:
    """A sandbox run as the model reads it, in the reference's layout (code_judge_utils.py)
    without its execution time, which would make identical runs read differently."""
    if result.ok:
        parts = ["Tool call success"]
    else:
        parts = ["Tool call failure", f"reason: {result.status}"]
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            parts.append(f"{stream}: " + text.rstrip("\n"))
    return "\n".join(parts)


def truncate_middle(text: str, limit: int) -> str:
    """`text` if it has at most `limit` characters, else its first and last characters (`limit`
    in all) around a note of how many were cut."""
    if limit < 1:
        raise ValueError(f"truncation limit must be at least 1 character, got {limit}")
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n...[{len(text) - limit} characters cut]...\n{text[-tail:]}"


def render_tool_responses(outputs: Sequence[str]) -> str:
    """The user turn that answers one assistant turn's calls: one block per call."""
    if not outputs:
        raise ValueError("a tool-response turn needs at least one response")
    return "\n".join(f"<tool_response>\n{output}\n</tool_response>" for output in outputs)


def answer_block(text: str) -> str | None:
    """The content of the last closed `<answer>...</answer>` block, stripped; None if none."""
    blocks = _ANSWER.findall(text)
    return blocks[-1].strip() if blocks else None


def final_answer(text: str) -> str | None:
    """The math answer of a final turn: the last answer block's `\\boxed{}` if it has one, else
    the whole block; without a block, the last `\\boxed{}` anywhere (the reference grades the
    last box of the response); else None."""
    # Imported here: math-verify loads SymPy, which parsing tool calls has no use for.
    from rstar_pipelines.math.answers import extract_boxed

    block = answer_block(text)
    if block is None:
        return extract_boxed(text)
    return extract_boxed(block) or block or None


def agent_prompt(
    system: PromptTemplate, user: PromptTemplate, question: str, domain: str
) -> list[dict]:
    """The chat a rollout starts from: the system prompt and the problem, rendered."""
    if domain not in ("math", "code"):
        raise ValueError(f"domain must be 'math' or 'code', got {domain!r}")
    variables = {"question": question, "domain": domain}
    return [
        {"role": "system", "content": system.render(**variables)},
        {"role": "user", "content": user.render(**variables)},
    ]
