"""Answer extraction, equivalence and voting, on MATH-500's real answers with the real checker."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rstar_pipelines.math.answers import MajorityVote, equivalent, extract_boxed, majority_answer

MATH500 = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "math500_test.json"


@pytest.fixture(scope="module")
def math500_answers() -> dict[int, str]:
    if not MATH500.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{MATH500} is missing in CI")
        pytest.skip(f"{MATH500} not present (it lives in ../shared/data beside the checkout)")
    return {row["index"]: row["answer"] for row in json.loads(MATH500.read_text())}


def test_every_math500_answer_matches_itself_through_math_verify_and_a_box(math500_answers):
    assert len(math500_answers) == 500
    failures = []
    for index, answer in math500_answers.items():
        boxed = extract_boxed(f"So the final answer is $\\boxed{{{answer}}}$.")
        # Delimiters make the strings differ, so this goes through math-verify
        # rather than the identical-string shortcut.
        if not (
            boxed == answer
            and equivalent(answer, answer)
            and equivalent(answer, f"${answer}$")
            and equivalent(f"\\({answer}\\)", boxed)
        ):
            failures.append((index, answer, boxed))
    assert failures == []


# (MATH-500 index, its gold answer, equivalent forms, near misses)
REAL_CASES = [
    (
        2,
        r"\frac{14}{3}",
        ["14/3", r"\dfrac{14}{3}", r"4\frac{2}{3}", "4.666667"],
        [r"\frac{13}{3}", "4.67"],
    ),
    (162, r"\dfrac{17}{50}", ["17/50", r"\frac{17}{50}", "0.34", r"34\%"], ["0.35"]),
    (264, r"1\frac{4}{5}", ["9/5", "1.8", r"\tfrac95"], [r"\frac{4}{5}"]),
    (472, r"137 \frac{1}{2}", ["137.5", "275/2"], ["137"]),
    (307, r"(-\infty, 0]", [r"(-\infty,0]", r"x \le 0"], [r"(-\infty, 0)", r"[0, \infty)"]),
    (
        293,
        r"\left(\frac{3}{5},\frac{8}{3}\right]",
        [r"(0.6, 8/3]"],
        [r"\left[\frac{3}{5},\frac{8}{3}\right]"],
    ),
    (
        435,
        r"(-\infty, 2) \cup (3, \infty)",
        [r"(-\infty,2)\cup(3,\infty)"],
        [r"(-\infty, 2] \cup (3, \infty)"],
    ),
    (
        0,
        r"\left( 3, \frac{\pi}{2} \right)",
        [r"(3, \pi/2)", r"(3,\frac{\pi}2)"],
        [r"\left( 3, \frac{\pi}{3} \right)", r"(\frac{\pi}{2}, 3)"],
    ),
    (206, r"\left( \frac{3}{2}, -13 \right)", ["(1.5, -13)"], ["(1.5, 13)"]),
    (
        73,
        r"\frac{3\sqrt{3}}{4}",
        [r"\frac{3}{4}\sqrt3", r"\frac{\sqrt{27}}{4}", "1.299038"],
        [r"\frac{3\sqrt{2}}{4}"],
    ),
    (8, r"3\sqrt{13}", [r"\sqrt{117}", r"3 \sqrt{13}"], ["3", r"\sqrt{13}"]),
    (96, r"1 \pm \sqrt{19}", [r"1 - \sqrt{19}, 1 + \sqrt{19}"], [r"1 + \sqrt{19}"]),
    (36, "3, 5, 7", ["7, 5, 3", r"\{3,5,7\}"], ["3, 5"]),
    (25, "1,-2", ["-2, 1"], ["1, 2"]),
    (7, r"90^\circ", ["90", r"90^{\circ}", r"90\text{ degrees}"], [r"89^\circ", r"\frac{\pi}{2}"]),
    (
        166,
        r"\frac{270}7\text{ degrees}",
        [r"\frac{270}{7}", r"\frac{270}{7}^\circ"],
        [r"\frac{270}{11}"],
    ),
    (227, r"\text{(C)}", ["C", "(C)", r"\textbf{(C)}"], [r"\text{(B)}"]),
    (4, r"\text{Evelyn}", ["Evelyn"], [r"\text{Emily}"]),
    (459, r"\$18.90", ["18.90", "18.9", r"\$18.9"], [r"\$18.91"]),
    (242, r"\$32,\!348", ["32348", "32,348"], ["32347"]),
    (198, r"10,\!080", ["10080", "10,080"], ["10,081"]),
    (
        408,
        r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}",
        [r"\begin{pmatrix} 0.2 \\ -3.6 \end{pmatrix}"],
        [r"\begin{pmatrix} -18/5 \\ 1/5 \end{pmatrix}"],
    ),
]


@pytest.mark.parametrize(
    ("index", "gold", "same", "different"), REAL_CASES, ids=[str(c[0]) for c in REAL_CASES]
)
def test_real_answers_against_alternative_forms_and_near_misses(
    math500_answers, index, gold, same, different
):
    assert math500_answers[index] == gold
    for form in same:
        assert equivalent(gold, form), form
        assert equivalent(form, gold), form
    for form in different:
        assert not equivalent(gold, form), form
        assert not equivalent(form, gold), form


def test_notable_math_verify_behaviour():
    # Percent is read as both n and n/100, so equivalence is not transitive.
    assert equivalent(r"10\%", "10") and equivalent(r"10\%", "0.1")
    assert not equivalent("10", "0.1")
    # Three digits after a comma are a thousands group; otherwise a comma makes a set.
    assert equivalent("58,500", "58500")
    assert not equivalent("58,500", "58, 500")
    # A two-element (a, b) is ambiguous between point and open interval and also
    # matches the set a, b. A tuple as prediction matches a reordered bare list
    # (verify is not symmetric and equivalent tries both orders).
    assert equivalent("(1,2)", "1, 2")
    assert equivalent(r"\left( 3, \frac{\pi}{2} \right)", r"\frac{\pi}{2}, 3")
    assert not equivalent("(1,2,3)", "(3,2,1)")
    # Mixed numbers need a numeric fraction; otherwise it is a product.
    assert equivalent(r"2\frac{\pi}{3}", r"\frac{2\pi}{3}")
    # Degrees are dropped, not converted to radians.
    assert not equivalent(r"30^\circ", r"\frac{\pi}{6}")
    # Plain-text Python/ASCII math is not understood.
    assert not equivalent("x**2", "x^2")
    assert not equivalent("pi", r"\pi")
    # Floats compare at 6 decimals.
    assert equivalent(r"\frac13", "0.333333")
    assert not equivalent(r"\frac13", "0.3333")


def test_equivalent_never_raises_on_malformed_input():
    assert equivalent("}{", "}{")
    assert equivalent(r"\frac{1}{", r"  \frac{1}{ ")
    assert not equivalent(r"\frac{1}{", r"\frac{1}{2")
    assert not equivalent("", "")
    assert not equivalent("   ", "5")
    assert not equivalent(r"\begin{pmatrix", "1")
    assert not equivalent("$$$", "$")


def test_equivalent_from_worker_threads():
    pairs = [
        (r"\frac{1}{2}", "0.5", True),
        (r"(-\infty, 3]", r"(-\infty, 3)", False),
        (r"2\sqrt{2}", r"\sqrt{8}", True),  # fresh strings: not answered by the parse cache
        (r"\frac{7}{9}", "7/9", True),
        (r"\frac{7}{9}", "0.78", False),
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: equivalent(p[0], p[1]), pairs))
    assert results == [expected for _, _, expected in pairs]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"first \boxed{3}, then \fbox{4}, finally \boxed{5}", "5"),
        (r"only \fbox{x^{2}}", "x^{2}"),
        (r"The answer is $\boxed 5$.", "5"),
        (r"\boxed{ 42. }", "42"),
        (r"\boxed{3.5}", "3.5"),
        (r"\boxed {7}", "7"),
        ("no box here", None),
        (r"\boxed{}", None),
        (r"\boxed{2} and then \boxed{\frac{1}{", None),  # truncated last box
        (r"\boxedfoo{2}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_majority_accepts_seven_of_ten_in_different_forms():
    half = [r"\frac{1}{2}", "0.5", "1/2", r"\dfrac12", r"\tfrac{1}{2}", "0.50", r"\frac{2}{4}"]
    answers = [half[0], "3", half[1], half[2], half[3], "2", half[4], half[5], "3", half[6]]
    vote = majority_answer(answers, threshold=0.6)
    assert vote == MajorityVote(
        answer=r"\frac{1}{2}", share=0.7, members=(0, 2, 3, 4, 6, 7, 9), accepted=True, classes=3
    )


def test_majority_rejects_five_of_ten():
    answers = ["0.5", "3", r"\frac12", "3", "1/2", "3", "0.50", "7", r"\frac{1}{2}", "8"]
    vote = majority_answer(answers, threshold=0.6)
    assert vote.answer == "0.5"
    assert vote.members == (0, 2, 4, 6, 8)
    assert vote.share == 0.5
    assert not vote.accepted
    assert vote.classes == 4


def test_majority_counts_none_in_the_denominator():
    vote = majority_answer([r"90^\circ", None, "90", None], threshold=0.6)
    assert vote.members == (0, 2)
    assert vote.share == 0.5
    assert not vote.accepted
    assert majority_answer([r"90^\circ", None, "90"], threshold=0.6).accepted


def test_majority_tie_goes_to_first_class():
    vote = majority_answer(["7", r"\frac{1}{2}", "7.0", "0.5"], threshold=0.5)
    assert vote == MajorityVote(answer="7", share=0.5, members=(0, 2), accepted=True, classes=2)


@pytest.mark.parametrize("answers", [[], [None, None], [None, "  "]])
def test_majority_of_nothing(answers):
    assert majority_answer(answers, threshold=0.0) == MajorityVote(
        answer=None, share=0.0, members=(), accepted=False, classes=0
    )
