"""Multi-turn rollouts with a scripted policy and the real sandbox (process backend).

The policy reads the conversation so far and answers by rules; it counts one token per
character, so every budget below is computed from the lengths of the scripted turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rstar_pipelines.agent.format import agent_prompt
from rstar_pipelines.agent.reward import AgentProblem, rewards
from rstar_pipelines.agent.rollout import RolloutConfig, ToolCall, group_bytes, run_rollouts
from rstar_pipelines.pipeline.prompts import PromptTemplate
from tests.fakes.agent import AgentPolicy, call, response

PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "prompts"
SYSTEM = PromptTemplate.load(PROMPTS, "agent_system.jinja")
USER = PromptTemplate.load(PROMPTS, "agent_user.jinja")


QUESTION = "What is seven times six divided by 84?"
T1 = "Let me compute it.\n" + call("print(x * 6 / 84)")
T2 = "I forgot to read x.\n" + call("x = int(input())\nprint(x * 6 / 84)", "7")
T3 = "The tool printed 0.5.\n<answer>The answer is \\boxed{1/2}.</answer>"
RETRY = [(QUESTION, [T1]), ("NameError", [T2]), ("stdout: 0.5", [T3])]


def prompt(question: str = QUESTION, domain: str = "math") -> list[dict]:
    return agent_prompt(SYSTEM, USER, question, domain)


def test_call_error_retry_answer(counting_sandbox):
    policy = AgentPolicy(RETRY)
    config = RolloutConfig(timeout_s=3.0, memory_mb=128)
    [[trajectory]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, config, seed=5)

    assert trajectory.prompt == prompt()
    [a1, u1, a2, u2, a3] = trajectory.messages
    assert [m["role"] for m in trajectory.messages] == ["assistant", "user"] * 2 + ["assistant"]
    assert (a1["content"], a2["content"], a3["content"]) == (T1, T2, T3)
    # The real traceback of the first call, the real output of the second.
    assert u1["content"].startswith(
        "<tool_response>\nTool call failure\nreason: runtime_error\nstderr: Traceback"
    )
    assert u1["content"].endswith("NameError: name 'x' is not defined\n</tool_response>")
    assert u2["content"] == response("Tool call success\nstdout: 0.5")
    assert trajectory.tool_calls == [
        ToolCall(
            "print(x * 6 / 84)",
            "",
            "runtime_error",
            u1["content"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"),
        ),
        ToolCall(
            "x = int(input())\nprint(x * 6 / 84)", "7", "ok", "Tool call success\nstdout: 0.5"
        ),
    ]
    assert trajectory.finish_reason == "answer"
    assert trajectory.final_text == T3
    assert trajectory.completion_tokens == len(T1) + len(T2) + len(T3)

    # Three turns, three generate calls: each the conversation so far, seeded per turn.
    chats = [prompts for prompts, _ in policy.calls]
    assert chats == [[prompt()], [[*prompt(), a1, u1]], [[*prompt(), a1, u1, a2, u2]]]
    assert [params.seed for _, params in policy.calls] == [5, 6, 7]
    assert [params.max_tokens for _, params in policy.calls] == [
        1024,
        1024 - len(T1),
        1024 - len(T1) - len(T2),
    ]
    # Two turns with a call, two sandbox runs with the configured limits.
    assert [[(j.code, j.stdin) for j in batch] for batch in counting_sandbox.batches] == [
        [("print(x * 6 / 84)", "")],
        [("x = int(input())\nprint(x * 6 / 84)", "7")],
    ]
    assert {(j.timeout_s, j.memory_mb) for b in counting_sandbox.batches for j in b} == {(3.0, 128)}

    problem = AgentProblem("p1", "math", QUESTION, answer="0.5")
    assert rewards([[trajectory]], [problem], counting_sandbox) == [[1.0]]


def test_malformed_call_gets_the_decode_error_and_runs_nothing(counting_sandbox):
    broken = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}\n</tool_call>'
    answer = "<answer>\\boxed{1}</answer>"
    policy = AgentPolicy([(QUESTION, [broken]), ("Failed to decode", [answer])])
    [[trajectory]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, RolloutConfig())

    with pytest.raises(json.JSONDecodeError) as err:
        json.loads('\n{"name": "python", "arguments": {"code": "print(1)"}\n')
    error = f"Failed to decode tool call: {err.value}"
    assert trajectory.messages[1]["content"] == response(error)
    assert trajectory.tool_calls == [ToolCall("", "", None, error)]
    assert trajectory.finish_reason == "answer"
    assert counting_sandbox.batches == []  # nothing to run


TWO_CALLS = "Two checks.\n" + call("print(1)") + "\n" + call("print(2)")


@pytest.mark.parametrize("all_tool_calls", [True, False])
def test_two_calls_in_one_turn(counting_sandbox, all_tool_calls):
    policy = AgentPolicy([(QUESTION, [TWO_CALLS]), ("stdout: 1", ["<answer>\\boxed{1}</answer>"])])
    config = RolloutConfig(all_tool_calls=all_tool_calls)
    [[trajectory]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, config)

    one, two = "Tool call success\nstdout: 1", "Tool call success\nstdout: 2"
    if all_tool_calls:
        assert trajectory.messages[1]["content"] == response(one, two)
        assert trajectory.tool_calls == [
            ToolCall("print(1)", "", "ok", one),
            ToolCall("print(2)", "", "ok", two),
        ]
        assert [[j.code for j in b] for b in counting_sandbox.batches] == [["print(1)", "print(2)"]]
    else:  # the reference: only the first call runs; the second gets no response
        assert trajectory.messages[1]["content"] == response(one)
        assert trajectory.tool_calls == [ToolCall("print(1)", "", "ok", one)]
        assert [[j.code for j in b] for b in counting_sandbox.batches] == [["print(1)"]]
    assert trajectory.finish_reason == "answer"


def test_tool_output_is_middle_truncated(counting_sandbox):
    policy = AgentPolicy(
        [(QUESTION, [call("print('a' * 3000)")]), ("cut]", ["<answer>no</answer>"])]
    )
    config = RolloutConfig(max_tool_response_chars=40)
    [[trajectory]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, config)
    # "Tool call success\nstdout: " is 26 characters, 3026 with the a's: 40 kept, 2986 cut.
    kept = "Tool call success\nst\n...[2986 characters cut]...\n" + "a" * 20
    assert trajectory.messages[1]["content"] == response(kept)
    assert trajectory.tool_calls[0].output == kept and trajectory.tool_calls[0].status == "ok"


def test_max_turns_ends_on_the_assistant_turn_without_running_its_call(counting_sandbox):
    policy = AgentPolicy([("", [call("print(1)")])])  # calls the tool forever
    [[trajectory]] = run_rollouts(
        policy, counting_sandbox, [prompt()], 1, RolloutConfig(max_turns=2)
    )
    assert [m["role"] for m in trajectory.messages] == ["assistant", "user", "assistant"]
    assert trajectory.finish_reason == "max_turns"
    assert len(trajectory.tool_calls) == 1  # the second turn's call never ran
    assert len(counting_sandbox.batches) == 1 and len(policy.calls) == 2


def test_token_budget(counting_sandbox):
    rules = [(QUESTION, [T1]), ("NameError", [T2])]
    # Budget spent exactly by the first turn: its call is not run, the trajectory stops there.
    config = RolloutConfig(max_response_tokens=len(T1))
    [[spent]] = run_rollouts(AgentPolicy(rules), counting_sandbox, [prompt()], 1, config)
    assert [m["content"] for m in spent.messages] == [T1]
    assert (spent.finish_reason, spent.completion_tokens, spent.tool_calls) == (
        "length",
        len(T1),
        [],
    )
    assert counting_sandbox.batches == []

    # Ten tokens left for the second turn: it is cut there.
    policy = AgentPolicy(rules)
    config = RolloutConfig(max_response_tokens=len(T1) + 10)
    [[cut]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, config)
    assert [m["role"] for m in cut.messages] == ["assistant", "user", "assistant"]
    assert cut.final_text == T2[:10]
    assert (cut.finish_reason, cut.completion_tokens) == ("length", len(T1) + 10)
    assert [params.max_tokens for _, params in policy.calls] == [len(T1) + 10, 10]


def test_turn_cap(counting_sandbox):
    policy = AgentPolicy(RETRY)
    config = RolloutConfig(max_turn_tokens=len(T1), max_response_tokens=10_000)
    [[trajectory]] = run_rollouts(policy, counting_sandbox, [prompt()], 1, config)
    # T2 is longer than T1: the cap cuts the second turn, which ends the trajectory.
    assert len(T2) > len(T1)
    assert [m["content"] for m in trajectory.messages[::2]] == [T1, T2[: len(T1)]]
    assert trajectory.finish_reason == "length"
    assert [params.max_tokens for _, params in policy.calls] == [len(T1), len(T1)]


def test_a_turn_over_its_own_budget_is_discarded_with_the_responses_it_followed(counting_sandbox):
    short = call("print(1)")
    long = "Let me think about it for a while before I try anything. " + short
    answer = "<answer>\\boxed{1}</answer>"
    policy = AgentPolicy([(QUESTION, [short, long]), ("stdout: 1", [answer])])
    # Both first turns fit; then the short trajectory has room for the answer, the long one only
    # for 10 tokens. One generate call serves both with the larger budget left, and the long
    # one's answer overruns its own.
    budget = len(long) + 10
    assert len(answer) > 10 and budget - len(short) >= len(answer)
    config = RolloutConfig(max_response_tokens=budget)
    [[fits, over]] = run_rollouts(policy, counting_sandbox, [prompt()], 2, config)

    assert [m["content"] for m in fits.messages[::2]] == [short, answer]
    assert (fits.finish_reason, fits.completion_tokens) == ("answer", len(short) + len(answer))
    assert [m["content"] for m in over.messages] == [long]
    assert (over.finish_reason, over.completion_tokens, over.tool_calls) == (
        "length",
        len(long),
        [],
    )
    assert [(len(p), params.max_tokens) for p, params in policy.calls] == [
        (1, budget),
        (2, budget - len(short)),
    ]
    assert len(counting_sandbox.batches[0]) == 2  # both calls ran before the overrun


def test_one_generate_and_one_sandbox_run_per_turn_over_all_live_trajectories(counting_sandbox):
    other = "What is the square of three?"
    policy = AgentPolicy(
        [
            *RETRY,
            (other, ["<answer>\\boxed{9}</answer>", call("print(3 ** 2)")]),
            ("stdout: 9", ["<answer>\\boxed{9}</answer>"]),
        ]
    )
    prompts = [prompt(), prompt(other)]
    groups = run_rollouts(policy, counting_sandbox, prompts, 2, RolloutConfig(), seed=0)

    # Turn 1: both prompts, two samples each. Turn 2: the three that called the tool.
    # Turn 3: the first prompt's two retries.
    assert [(len(p), params.n) for p, params in policy.calls] == [(2, 2), (3, 1), (2, 1)]
    assert policy.calls[0][0] == prompts
    turn2 = policy.calls[1][0]
    assert [chat[:2] for chat in turn2] == [prompts[0], prompts[0], prompts[1]]
    assert [len(chat) for chat in turn2] == [4, 4, 4]
    assert [[j.code for j in batch] for batch in counting_sandbox.batches] == [
        ["print(x * 6 / 84)", "print(x * 6 / 84)", "print(3 ** 2)"],
        ["x = int(input())\nprint(x * 6 / 84)"] * 2,
    ]

    [first, second] = groups
    assert [len(t.messages) for t in first] == [5, 5]
    assert [len(t.messages) for t in second] == [1, 3]
    assert all(t.finish_reason == "answer" for g in groups for t in g)
    problems = [
        AgentProblem("p1", "math", QUESTION, answer="0.5"),
        AgentProblem("p2", "math", other, answer="9"),
    ]
    assert rewards(groups, problems, counting_sandbox) == [[1.0, 1.0], [1.0, 1.0]]


def test_bad_input_is_refused(sandbox):
    policy = AgentPolicy(RETRY)
    with pytest.raises(ValueError, match="prompt 0 must be chat messages"):
        run_rollouts(policy, sandbox, ["What is 2 + 3?"], 1, RolloutConfig())
    with pytest.raises(ValueError, match="at least 1"):
        run_rollouts(policy, sandbox, [prompt()], 0, RolloutConfig())
    with pytest.raises(ValidationError):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValidationError):
        RolloutConfig(max_tool_calls=3)


def test_a_real_model_rolls_out_within_the_limits_reproducibly(tiny_base, sandbox):
    from rstar_pipelines.llm import load_llm

    llm = load_llm("transformers", tiny_base)
    prompts = [prompt(), prompt("Read n and print n * 2.", "code")]
    config = RolloutConfig(max_turns=2, max_response_tokens=12)
    groups = run_rollouts(llm, sandbox, prompts, 2, config, seed=3)
    assert [len(g) for g in groups] == [2, 2]
    for trajectory in (t for g in groups for t in g):
        assert trajectory.messages[-1]["role"] == "assistant"
        assert 1 <= trajectory.completion_tokens <= 12
        assert trajectory.finish_reason in ("answer", "max_turns", "length")
    again = run_rollouts(llm, sandbox, prompts, 2, config, seed=3)
    assert [[t.messages for t in g] for g in again] == [[t.messages for t in g] for g in groups]


def test_the_memory_budget_bounds_the_prompts_rolled_out_at_once(counting_sandbox):
    """A budget that holds one prompt's rollouts rolls the prompts out one after another, with
    the same trajectories as when all run at once (each turn keeps its seed)."""
    config = RolloutConfig(timeout_s=3.0, memory_mb=128)
    one_prompt = 1.5 * group_bytes(config, 2) / 2**20
    bounded, unbounded = AgentPolicy(RETRY), AgentPolicy(RETRY)
    prompts = [prompt(), prompt()]
    groups = run_rollouts(bounded, counting_sandbox, prompts, 2, config, 5, None, one_prompt)
    expected = run_rollouts(unbounded, counting_sandbox, prompts, 2, config, seed=5)
    assert groups == expected
    # A later turn asks for each open trajectory: two of one prompt, or four of both.
    assert max(len(chats) for chats, _ in bounded.calls) == 2
    assert max(len(chats) for chats, _ in unbounded.calls) == 4
    longer = config.model_copy(update={"max_response_tokens": 4096})
    assert group_bytes(longer, 2) > group_bytes(config, 2) > group_bytes(config, 1)
