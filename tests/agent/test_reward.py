"""Binary outcome rewards: math answers by equivalence, programs by their verified tests."""

from __future__ import annotations

import pytest

from rstar_pipelines.agent.reward import AgentProblem, rewards
from rstar_pipelines.agent.rollout import Trajectory

PROMPT = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]


def finished(*turns: str) -> Trajectory:
    """A trajectory whose assistant turns are `turns` (tool responses in between)."""
    messages = []
    for turn in turns:
        if messages:
            messages.append({"role": "user", "content": "<tool_response>\nok\n</tool_response>"})
        messages.append({"role": "assistant", "content": turn})
    return Trajectory(PROMPT, messages, [], 10, "answer")


HALF = AgentProblem("half", "math", "What is 1/2?", answer="0.5")
DOUBLE = AgentProblem(
    "double", "code", "Read n, print 2n.", inputs=("3\n", "10\n"), labels=("6", "20")
)
RIGHT = "print(int(input()) * 2)"
WRONG = "print(int(input()) + 3)"  # right on 3 only


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


def test_math_rewards_by_equivalence(sandbox):
    group = [
        finished("<answer>The answer is \\boxed{1/2}.</answer>"),
        finished("<answer>\\boxed{\\frac{1}{2}}</answer>"),
        finished("<answer>0.5</answer>"),  # a block without a box is the answer itself
        finished("so it is \\boxed{0.5}"),  # no block: the last box counts
        finished("<answer>\\boxed{0.25}</answer>"),
        finished("I do not know."),
        # Only the final turn counts: an earlier turn's right answer does not.
        finished("<answer>\\boxed{0.5}</answer>", "<answer>\\boxed{2}</answer>"),
        finished("<answer>\\boxed{2}</answer>", "<answer>\\boxed{0.5}</answer>"),
    ]
    assert rewards([group], [HALF], sandbox) == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]]


def test_code_rewards_run_the_answer_blocks_program(counting_sandbox):
    group = [
        finished(f"<answer>\n{fenced(RIGHT)}\n</answer>"),
        finished(f"<answer>\n{fenced(WRONG)}\n</answer>"),  # passes one test of two
        # The answer block's program is graded, not a draft before it ...
        finished(f"Draft:\n{fenced(WRONG)}\n<answer>\n{fenced(RIGHT)}\n</answer>"),
        finished(f"Draft:\n{fenced(RIGHT)}\n<answer>\n{fenced(WRONG)}\n</answer>"),
        # ... and without a block, the turn's program.
        finished(f"Here it is:\n{fenced(RIGHT)}"),
        finished(f"<answer>\n{fenced('print(1 / 0)')}\n</answer>"),
        finished("<answer>I cannot solve it.</answer>"),
    ]
    assert rewards([group], [DOUBLE], counting_sandbox, timeout_s=3.0, memory_mb=128) == [
        [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    ]
    # Six programs (the last trajectory has none) on two inputs each, in one run.
    [jobs] = counting_sandbox.batches
    assert len(jobs) == 12
    assert {(j.stdin, j.timeout_s, j.memory_mb) for j in jobs} == {
        ("3\n", 3.0, 128),
        ("10\n", 3.0, 128),
    }


def test_mixed_groups_keep_their_order_and_share_one_sandbox_run(counting_sandbox):
    square = AgentProblem("sq", "code", "Read n, print n*n.", inputs=("4\n",), labels=("16",))
    groups = [
        [finished(f"<answer>{fenced(RIGHT)}</answer>"), finished("nothing")],
        [finished("<answer>\\boxed{1/2}</answer>")],
        [finished(fenced("n = int(input())\nprint(n * n)")), finished(fenced(RIGHT))],
    ]
    assert rewards(groups, [DOUBLE, HALF, square], counting_sandbox) == [
        [1.0, 0.0],
        [1.0],
        [1.0, 0.0],
    ]
    assert len(counting_sandbox.batches) == 1


def test_only_math_needs_no_sandbox(counting_sandbox):
    assert rewards([[finished("\\boxed{0.5}")]], [HALF], counting_sandbox) == [[1.0]]
    assert counting_sandbox.batches == []


def test_bad_problems_are_refused(sandbox):
    with pytest.raises(ValueError, match="'m' has no gold answer"):
        AgentProblem("m", "math", "q")
    with pytest.raises(ValueError, match="2 inputs and 1 labels"):
        AgentProblem("c", "code", "q", inputs=("1", "2"), labels=("1",))
    with pytest.raises(ValueError, match="domain"):
        AgentProblem("x", "physics", "q", answer="1")
    with pytest.raises(ValueError, match="2 groups of trajectories for 1 problems"):
        rewards([[], []], [HALF], sandbox)
