"""Final answers: pull them out of solutions, compare them, vote on them.

Comparison is delegated to math-verify (LaTeX -> SymPy, then numeric, symbolic,
set/interval/matrix comparison). What it does with the MATH benchmark's answer
formats, checked against math-verify 0.9:

* numbers: ``0.5`` = ``\\frac12`` = ``1/2``; ``\\dfrac``/``\\tfrac`` = ``\\frac``;
  ``10,\\!080`` = ``10080``; floats are compared rounded to 6 decimals, so
  ``0.333333`` = ``\\frac13`` but ``0.3333`` is not.
* mixed numbers: ``4\\frac{2}{3}`` = ``14/3`` (an integer directly followed by a
  numeric ``\\frac``); ``2\\frac{\\pi}{3}`` stays a product.
* degrees and units: ``^\\circ``, ``\\text{ degrees}``, ``\\text{ cents}``,
  ``\\mbox{ inches}^2`` are dropped, so ``30^\\circ`` = ``30`` (but not ``\\pi/6``).
* dollars: ``\\$18.90`` = ``18.9`` (``\\$`` is an escaped sign, not a delimiter).
* percent: ``10\\%`` = ``10`` and ``10\\%`` = ``0.1``, yet ``10`` != ``0.1``.
* bare comma lists are sets: ``1, 2`` = ``2, 1`` = ``\\{1,2\\}``; ``1 \\pm \\sqrt{19}``
  is the two-element set. Tuples of three or more are ordered. A two-element
  ``(a, b)`` is read as an open interval and also matches the set ``a, b``.
* tuples vs bare lists: as *gold*, a tuple does not match a reordered list, but as
  *prediction* it does (``verify`` is not symmetric), see ``equivalent``.
* intervals: endpoints and brackets matter, ``(-\\infty, 3]`` != ``(-\\infty, 3)``.
* text: ``\\text{(C)}`` = ``(C)`` = ``C`` = ``c``; ``\\text{Evelyn}`` = ``Evelyn``.

Equivalence is therefore not transitive (percent, tuples vs sets), which is why
``majority_answer`` compares each answer with a class's first member only.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

__all__ = ["MajorityVote", "equivalent", "extract_boxed", "majority_answer"]

_TIMEOUT_S = 5
# (?![A-Za-z]) rather than \b: TeX ends a control word at any non-letter, so
# `\boxed5` is a box around 5 while `\boxedfoo` is another macro.
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# An unescaped `$`, `\(` or `\[` means the answer already carries math mode.
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")
_LATEX = (LatexExtractionConfig(),)
_EXPR = (ExprExtractionConfig(),)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, ``\\boxed X`` or ``\\fbox{...}``, else None.

    Only the last box counts: if it is unterminated (a truncated generation) the
    answer is None rather than an earlier, probably intermediate, box.
    """
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    content = _box_content(text, boxes[-1].end())
    if content is None:
        return None
    content = content.strip()
    if content.endswith("."):
        content = content[:-1].rstrip()
    return content or None


def _box_content(text: str, start: int) -> str | None:
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text):
        return None
    if text[i] != "{":
        # `\boxed 5`: the usual MATH convention takes the token up to space or `$`.
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2  # `\{` and `\}` are literal braces, not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def _normalise(answer: str) -> str:
    return " ".join(answer.split())


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which Python only allows in the main
    # thread; elsewhere it would raise, so workers run without a timeout and must
    # bound their own time (e.g. a process pool) if that matters.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=16384)
def _parsed(answer: str) -> tuple:
    """math-verify's parse of one answer: SymPy objects plus the raw match string."""
    latex = answer if _MATH_DELIMITER.search(answer) else f"${answer}$"
    result = parse(latex, _LATEX, parsing_timeout=_timeout())
    if all(isinstance(item, str) for item in result):
        # The plain-expression extractor is only a fallback: on LaTeX it grabs one
        # number out of the answer (`3\sqrt{13}` -> 3, `(-\infty, 0]` -> 0,
        # `-2,1` -> -2.1), which would make distinct answers match.
        result = parse(answer, _EXPR, parsing_timeout=_timeout()) or result
    return tuple(result)


@functools.lru_cache(maxsize=65536)
def _verified(a: str, b: str) -> bool:
    pa, pb = list(_parsed(a)), list(_parsed(b))
    if not pa or not pb:
        return False
    timeout = _timeout()
    return verify(pa, pb, timeout_seconds=timeout) or verify(pb, pa, timeout_seconds=timeout)


def equivalent(a: str, b: str) -> bool:
    """Whether two final answers are mathematically the same, per math-verify.

    Symmetric: true when ``verify`` accepts either order. math-verify's
    ``verify(gold, pred)`` is not symmetric: gold ``(-\\infty, 3]`` rejects the
    prediction ``x \\le 3`` while the reverse is accepted, and a gold tuple
    ``(3, \\pi/2)`` rejects the bare list ``\\pi/2, 3`` while the reverse is
    accepted. Trying both orders (as the rStar reference does) keeps the first
    kind of match at the cost of the second.

    Never raises. Identical (whitespace-normalised) non-empty strings are always
    equivalent; an empty answer is equivalent to nothing; anything math-verify
    cannot parse or compare is equivalent only to itself. Safe from worker
    threads (see ``_timeout``).
    """
    a, b = _normalise(a), _normalise(b)
    if not a or not b:
        return False
    if a == b:
        return True
    try:
        # Order the key so (a, b) and (b, a) share one cache entry.
        return _verified(min(a, b), max(a, b))
    except Exception:
        return False


@dataclass(frozen=True)
class MajorityVote:
    answer: str | None
    share: float
    members: tuple[int, ...]
    accepted: bool
    classes: int


def majority_answer(answers: Sequence[str | None], threshold: float) -> MajorityVote:
    """The largest class of equivalent answers, and whether its share reaches threshold.

    ``share`` divides by ``len(answers)``: a None (or blank) answer is a vote for
    nothing. Ties go to the class whose first member comes first.
    """
    classes: list[list[int]] = []
    for index, answer in enumerate(answers):
        if answer is None or not answer.strip():
            continue
        for members in classes:
            first = answers[members[0]]
            if answer == first or equivalent(answer, first):
                members.append(index)
                break
        else:
            classes.append([index])
    if not classes:
        return MajorityVote(answer=None, share=0.0, members=(), accepted=False, classes=0)
    # max() keeps the first of equal sizes, and classes are in first-member order.
    best = max(classes, key=len)
    share = len(best) / len(answers)
    return MajorityVote(
        answer=answers[best[0]],
        share=share,
        members=tuple(best),
        accepted=share >= threshold,
        classes=len(classes),
    )
