"""Pulling the gradable part out of a model's solution: its program or its boxed answer.

Both return ``(value, None)`` or ``(None, reason)``; reasons are short fixed strings
(the syntax error's message aside) so rejected completions can be counted by cause.

A fence left open at the very end of a completion still counts as a block: small
models often stop right after the code without closing it (EOS, or a "```" stop
string, which the backends drop from the text). A program cut off mid-statement
then fails ``ast.parse``; one cut between statements fails its tests. Callers that
want to reject every length-truncated completion should check its finish reason.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

__all__ = ["FencedBlock", "extract_final_answer", "extract_program", "fenced_blocks"]

_OPEN = re.compile(r"^[ \t]*```+[ \t]*([^\s`]*)[ \t]*$")
_CLOSE = re.compile(r"^[ \t]*```+[ \t]*$")
_PYTHON_TAGS = frozenset({"python", "py", "python3"})


@dataclass(frozen=True)
class FencedBlock:
    lang: str  # lowercased info string; "" for a bare fence
    body: str
    closed: bool
    line: int  # index of the opening fence among the text's lines


def fenced_blocks(text: str) -> list[FencedBlock]:
    """Every ``` fenced block of a Markdown text, in order."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if _CLOSE.match(lines[j])), None)
        body = lines[i + 1 : end if end is not None else len(lines)]
        # Fences indented inside a list item indent their body too.
        blocks.append(
            FencedBlock(
                lang=opening.group(1).lower(),
                body=textwrap.dedent("\n".join(body)),
                closed=end is not None,
                line=i,
            )
        )
        i = end + 1 if end is not None else len(lines)
    return blocks


def extract_program(completion: str) -> tuple[str | None, str | None]:
    """The last fenced block that is a non-empty, valid Python program.

    Blocks tagged python/py/python3 win over bare ones: a bare block after the code is
    usually a sample input or output, and ``6`` is valid Python too.
    """
    tagged, bare = [], []
    for block in fenced_blocks(completion):
        if block.lang in _PYTHON_TAGS:
            tagged.append(block.body)
        elif block.lang == "":
            bare.append(block.body)
    if not tagged and not bare:
        return None, "no code block"
    syntax_error = None
    for candidates in (tagged, bare):
        for source in reversed(candidates):
            try:
                module = ast.parse(source)
            except (SyntaxError, ValueError) as err:  # ValueError: a NUL byte in the source
                syntax_error = syntax_error or f"syntax error: {_describe(err)}"
                continue
            if module.body:  # a block of only comments or blank lines is no program
                return source.strip("\n") + "\n", None
    return None, syntax_error or "empty program"


def _describe(err: Exception) -> str:
    if isinstance(err, SyntaxError):
        return f"{err.msg} (line {err.lineno})"
    return str(err)


def extract_final_answer(completion: str) -> tuple[str | None, str | None]:
    """The content of the last ``\\boxed{}``."""
    # Imported here: math-verify loads SymPy, which program extraction has no use for.
    from rstar_pipelines.math.answers import extract_boxed

    answer = extract_boxed(completion)
    if answer is None:
        return None, "no \\boxed answer"
    return answer, None
