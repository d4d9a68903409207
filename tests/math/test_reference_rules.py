"""Golden cases of the reference's search rules (docs/rstar-math.md, "Reference rules and their
options"), each beside the option that departs from it.

Every expected tree below was produced by running the reference implementation (microsoft/rStar,
branch rStar-math, b3c1846: its MCTS agent and Python tool, with vLLM replaced by the same
scripted samples) on the same script, and is matched here node for node: ids, visits, Q, the
first value, terminal flags, final answers and texts. Steps are written the way a policy trained
on the reference's data writes them, tags on lines of their own.
"""

from __future__ import annotations

import pytest

from rstar_pipelines.math import mcts as mcts_module
from rstar_pipelines.math.mcts import MCTSConfig, Problem, search
from rstar_pipelines.math.pairs import preference_pairs
from rstar_pipelines.math.steps import ANSWER_END, CODE_END, STEP_END, reference_answer
from tests.fakes.math import (
    OUT5,
    OUT6,
    PROMPT,
    A,
    B,
    C,
    D,
    F,
    ScriptedPPM,
    StepPolicy,
    golden_search,
)

TIMEOUT = "TimeoutError: 'Execution of the code snippet has timed out for exceeding 1 seconds.'"
SIX = "\n<answer>\\boxed{6}" + ANSWER_END


def grow(sandbox, script, answer="5", ppm=None, **config):
    config = {"width": 3, "errors_threshold": 1, **config}
    policy = StepPolicy(script)
    tree = search(
        [Problem("p", "What is 2 + 3?", answer)],
        policy,
        sandbox,
        MCTSConfig(**config),
        ppm=ppm,
        prompt=PROMPT,
    )[0]
    return tree, policy


def table(tree) -> dict[str, tuple]:
    """node id -> (visits, Q, terminal, final answer, text)."""
    return {
        r["node_id"]: (r["visits"], round(r["q"], 6), r["terminal"], r["final_answer"], r["text"])
        for r in tree.nodes.to_pylist()
    }


# -- 1. a step that timed out is run again by the steps after it ------------------------------

T1 = "<code>\nx = 3\n" + STEP_END
T2 = "\nwhile True:\n    pass\n" + STEP_END
T3 = "\nprint(x + 2)\n" + CODE_END
LOOP = {"": [T1], T1: [T2], T1 + T2: [T3], T1 + T2 + T3 + OUT5: [F]}


def test_a_timed_out_step_is_run_again(sandbox):
    # Round 1 allows two failing steps in a row: the loop times out (one error), and the
    # next step's program holds the loop again, so it times out too: the branch dies of code
    # errors (the reference's check for a timed-out step reads the text after the step's own
    # code, which is empty for a step that leaves the block open).
    tree, _ = grow(sandbox, LOOP, rollouts=1, max_depth=6, errors_threshold=2, exec_timeout_s=1)
    closed = f"{T3}\n<output><output>{TIMEOUT}<end_of_output><end_of_output>"
    assert table(tree) == {
        "0": (0, 0.0, False, None, ""),
        "0.1": (0, 0.0, False, None, T1),
        "0.1.1": (0, 0.0, True, None, T2),
        "0.1.1.1": (1, -1.0, True, "TOO_MANY_CODE_ERRORS", closed),
    }
    assert tree.root.children[0].children[0].observation == TIMEOUT


def test_timed_out_steps_skip_leaves_the_step_out(sandbox):
    tree, _ = grow(
        sandbox,
        LOOP,
        rollouts=1,
        max_depth=6,
        errors_threshold=2,
        exec_timeout_s=1,
        timed_out_steps="skip",
    )
    nodes = table(tree)
    assert nodes["0.1.1.1"] == (1, 1.0, True, None, T3 + OUT5)
    assert nodes["0.1.1.1.1"] == (1, 1.0, True, "5", F)


# -- 2. a rollout's budget is max_depth steps, one level each ---------------------------------

CHAIN = ["<code>\nx = 0\n" + STEP_END] + [f"\nx = x + {i}\n" + STEP_END for i in range(1, 6)]
LONG = {"".join(CHAIN[:i]): [CHAIN[i]] for i in range(len(CHAIN))}


def test_a_rollout_takes_max_depth_steps_and_leaves_the_last_node_unexpanded(sandbox):
    # Rollout 1 expands depths 0-3 and stops at the node it reached at depth 4, unexpanded.
    tree, _ = grow(sandbox, LONG, rollouts=1, max_depth=4)
    assert tree.rollout_paths == [["0", "0.1", "0.1.1", "0.1.1.1"]]
    assert len(tree.nodes) == 5 and not tree.nodes["terminal"].to_pylist()[-1]
    # Rollout 2 spends three steps descending to it, and expands it with its fourth: a code
    # step at depth max_depth is still open, the one below it (depth 5) is too deep.
    tree, _ = grow(sandbox, LONG, rollouts=3, max_depth=4)
    assert tree.rollout_paths == [["0", "0.1", "0.1.1", "0.1.1.1"], ["0.1.1.1.1"], []]
    assert table(tree) == {
        "0": (0, 0.0, False, None, ""),
        "0.1": (0, 0.0, False, None, CHAIN[0]),
        "0.1.1": (0, 0.0, False, None, CHAIN[1]),
        "0.1.1.1": (0, 0.0, True, None, CHAIN[2]),
        "0.1.1.1.1": (0, 0.0, True, None, CHAIN[3]),
        "0.1.1.1.1.1": (1, -1.0, True, "TOO_MANY_STEPS", CHAIN[4]),
    }


# -- 3. an empty \boxed{} is an ordinary step -------------------------------------------------

EB = "<code>\nx = 5\n" + STEP_END
EMPTY = "\nThe answer is \\boxed{}\n" + STEP_END
BOXES = {"": [EB], EB: [EMPTY], EB + EMPTY: [D], EB + EMPTY + D + OUT5: [F]}


def test_an_empty_box_is_an_ordinary_step(sandbox):
    # The step runs no code and adds nothing to the program: the next step still prints x.
    tree, _ = grow(sandbox, BOXES, rollouts=1, max_depth=6)
    assert table(tree) == {
        "0": (1, 1.0, False, None, ""),
        "0.1": (1, 1.0, False, None, EB),
        "0.1.1": (1, 1.0, False, None, EMPTY),
        "0.1.1.1": (1, 1.0, True, None, D + OUT5),
        "0.1.1.1.1": (1, 1.0, True, "5", F),
    }
    assert tree.root.children[0].children[0].kind == "text"


def test_empty_box_wrong_answer_ends_the_branch(sandbox):
    tree, _ = grow(sandbox, BOXES, rollouts=1, max_depth=6, empty_box="wrong_answer")
    assert table(tree)["0.1.1"] == (1, -1.0, True, None, EMPTY)
    assert (tree.root.visits, tree.root.q) == (1, -1.0)


# -- 4. a blank sample is an empty step ---------------------------------------------------------

BLANK = {"": [A, ""], A: [D], A + D + OUT5: [F]}


def test_a_blank_sample_is_kept_as_an_empty_step(sandbox):
    tree, _ = grow(sandbox, BLANK, rollouts=2, width=2, max_depth=4)
    assert table(tree) == {
        "0": (1, 1.0, False, None, ""),
        "0.1": (1, 1.0, True, None, A),
        "0.1.1": (1, 1.0, True, None, D + OUT5),
        "0.1.1.1": (1, 1.0, True, "5", F),
        "0.2": (0, 0.0, False, None, ""),
    }


def test_blank_samples_drop(sandbox):
    tree, _ = grow(sandbox, BLANK, rollouts=2, width=2, max_depth=4, blank_samples="drop")
    assert "0.2" not in table(tree)


# -- 5. duplicates are the same text, whatever stop string ended them --------------------------

SAME = "<code>\nx = 2 + 3\n"
TWICE = {
    "": [SAME + STEP_END, SAME + CODE_END],
    SAME + STEP_END: [D],
    SAME + STEP_END + D + OUT5: [F],
    SAME + CODE_END + "\n<output><end_of_output>": [F],
}


def test_duplicates_are_the_same_text(sandbox):
    tree, _ = grow(sandbox, TWICE, rollouts=2, width=2, max_depth=4)
    assert table(tree) == {
        "0": (1, 1.0, False, None, ""),
        "0.1": (1, 1.0, True, None, SAME + STEP_END),
        "0.1.1": (1, 1.0, True, None, D + OUT5),
        "0.1.1.1": (1, 1.0, True, "5", F),
    }


def test_dedupe_text_and_stop_keeps_both(sandbox):
    tree, _ = grow(sandbox, TWICE, rollouts=2, width=2, max_depth=4, dedupe="text_and_stop")
    assert table(tree)["0.2"][4] == SAME + CODE_END + "\n<output><end_of_output>"


# -- 6. final-answer pairs come from the paper -------------------------------------------------


def test_final_pairs_are_an_option(sandbox):
    tree = golden_search(sandbox, 4)
    kinds = {p.kind for p in preference_pairs(tree, 0.5, 5)}
    assert kinds == {"step", "final"}
    assert {p.kind for p in preference_pairs(tree, 0.5, 5, final_pairs=False)} == {"step"}


# -- the evaluation mode: the PPM values the answers, the gold answer is never read ------------

EVAL = {"": [A, B], A: [D], A + D + OUT5: [F], B: [D], B + D + OUT6: [SIX]}
# A PPM that prefers the wrong answer 6.
VALUES = {A: 0.1, B: 0.2, A + D + OUT5: 0.3, B + D + OUT6: 0.4, A + D + OUT5 + F: -0.5}
VALUES[B + D + OUT6 + SIX] = 0.9


def test_evaluation_mode_backs_up_the_ppm_and_never_reads_the_gold_answer(sandbox, monkeypatch):
    def no_gold(*args):
        raise AssertionError("the evaluation search compared an answer with a gold answer")

    monkeypatch.setattr(mcts_module, "equivalent", no_gold)
    ppm = ScriptedPPM(VALUES)
    tree, _ = grow(sandbox, EVAL, answer=None, ppm=ppm, rollouts=4, width=2, max_depth=4)
    # Each answer's PPM value goes up to the root like a reward (0.2 = (-0.5 + 0.9) / 2).
    assert {k: v[:4] for k, v in table(tree).items()} == {
        "0": (2, 0.2, False, None),
        "0.1": (2, -0.2, True, None),
        "0.1.1": (2, -0.1, True, None),
        "0.1.1.1": (1, -0.5, True, "5"),
        "0.2": (2, 0.55, True, None),
        "0.2.1": (2, 0.65, True, None),
        "0.2.1.1": (1, 0.9, True, "6"),
    }
    assert all(n.correct is None for n in tree.answers())
    from rstar_pipelines.math.evaluation import best_q_answer

    assert best_q_answer(tree) == "6"  # the PPM's pick, wrong against the gold answer 5


def test_evaluation_without_a_ppm_values_nothing(sandbox):
    tree, _ = grow(sandbox, EVAL, answer=None, rollouts=4, width=2, max_depth=4)
    assert {n.final_answer for n in tree.answers()} == {"5", "6"}
    assert all(n.visits == 0 and n.value is None for n in tree.answers())


def test_best_q_ties_go_to_the_shallowest_answer(sandbox):
    # Two answers valued 0.5 by the PPM: 6, a boxed step at depth 1 (it stopped at
    # <end_of_step>, so A stays beside it), and 5 at depth 3 below A. The reference reads the
    # tree level by level and sorts stably: 6 first (depth first, generation order, gives 5).
    shallow = "\nSo the answer is \\boxed{6}\n" + STEP_END
    script = {"": [A, shallow], A: [D], A + D + OUT5: [F]}
    values = {A: 0.1, shallow: 0.5, A + D + OUT5: 0.3, A + D + OUT5 + F: 0.5}
    ppm = ScriptedPPM(values)
    tree, _ = grow(sandbox, script, answer=None, ppm=ppm, rollouts=1, width=2, max_depth=4)
    assert [(n.node_id, n.q) for n in tree.answers()] == [("0.1.1.1", 0.5), ("0.2", 0.5)]
    from rstar_pipelines.math.evaluation import best_q_answer, ranked_answers

    assert ranked_answers(tree) == ["6", "5"]
    assert best_q_answer(tree) == "6"


# -- running a step: the reference's interpreter ------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reference", "script"),
    [
        # several printing statements: each output labelled by what it printed
        ("x = 5\nprint(x)\ny = 6\nprint(y)", "x: 5\ny: 6", "5\n6"),
        # a trailing expression shows its value
        ("x = 3\nx * 2", "6", "6"),
        # what prints before a trailing statement is not shown
        ("print(1)\nx = 2", "", "1"),
        # a whole output that reads as a number is rounded to 4 decimals when shorter
        ("print(1 / 3)", "0.3333", "0.3333"),
        # an exception: its type and message
        ("print(1 / 0)", "ZeroDivisionError: division by zero", None),
        # a `print` on the line of <end_of_code> is dropped with the line
        ("x = 4\nprint(x)<end_of_code>", "", "4"),
    ],
)
def test_observations(sandbox, code, reference, script):
    step = "<code>\n" + code + ("\n" + CODE_END if CODE_END not in code else "")
    script_ = {"": [step]}
    seen = {}
    for mode, expected in (("interpreter", reference), ("script", script)):
        tree, _ = grow(sandbox, script_, rollouts=1, max_depth=1, execution=mode)
        seen[mode] = tree.root.children[0].observation
        if expected is not None:
            assert seen[mode] == expected, mode
    if script is None:
        assert seen["script"] == seen["interpreter"]


def test_error_output_once(sandbox):
    tree, _ = grow(sandbox, {"": [C]}, rollouts=1, max_depth=1)
    assert "<output><output>ZeroDivisionError" in tree.root.children[0].text
    tree, _ = grow(sandbox, {"": [C]}, rollouts=1, max_depth=1, error_output="once")
    assert tree.root.children[0].text == C + "\n<output>ZeroDivisionError: division by zero" + (
        "<end_of_output>"
    )


# -- reading an answer step --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "answer"),
    [  # each answer as the reference's extract_math_answer gives it
        ("<answer>The answer is \\boxed{5}<end_of_answer>", "5"),
        ("So x = 2.\nThe answer is \\boxed{5}.", "So x = 2"),  # cut at the first ".\n"
        ("\\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("the answer is \\boxed{12", ""),  # unclosed: nothing, so an ordinary step
        ("boxed 7", "boxed 7"),  # no \boxed{: the whole text
        ("\\boxed{\\text{Evelyn}}", "Evelyn"),
        ("\\boxed{3 \\text{ and } 4}", "3  4"),
        ("\\boxed{}", ""),
        ("x \\boxed{{1}", "1}"),
        ("\\boxed{\\text{(C}}", "(C"),
    ],
)
def test_reference_answer(step, answer):
    assert reference_answer(step) == answer


def test_answers_last_box_reads_past_a_sentence_break(sandbox):
    step = "\nSo x = 5.\nThe answer is \\boxed{5}" + ANSWER_END
    script = {"": [EB], EB: [step]}
    for answers, expected in (("reference", "So x = 5"), ("last_box", "5")):
        tree, _ = grow(sandbox, script, rollouts=1, max_depth=4, answers=answers)
        assert [n.final_answer for n in tree.answers()] == [expected]
