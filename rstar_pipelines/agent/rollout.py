"""Multi-turn tool-using rollouts (rStar2-Agent, docs/agent.md), each trajectory on its own.

    trajectories = run_rollouts(llm, sandbox, prompts, n=4, config=RolloutConfig())
    # one list per prompt: its n Trajectory records

A prompt's first turn is one request for its `n` samples; then each trajectory runs its own
tool calls (in the sandbox with the other trajectories' calls waiting then) and asks for its
next turn (the conversation so far, which ends with a user tool-response turn, so the chat
template opens a new assistant turn), through `llm.coroutines`: over a fleet of servers a
trajectory moves on as soon as its own completion is in; an in-process model gets one batch per
turn over every live trajectory, and one sandbox run after it. A trajectory stops when its turn
makes no tool call ("answer"), when its turn was the last allowed one ("max_turns") or when its
token budget is spent or a turn was cut by a token limit ("length"). It never ends on a user
turn: the calls of a final turn are not run.

Each turn asks for at most the trajectory's budget left (capped by `max_turn_tokens`), as the
reference does. An in-process batch takes one `max_tokens`, the largest budget left among its
trajectories: a turn longer than its own trajectory's budget left is then discarded with the
tool responses it followed, so the trajectory ends, "length", on its previous assistant turn
(whose calls then count as not run) and never holds more than `max_response_tokens` model
tokens. The reference keeps the cut turn; either way such a trajectory ends without an answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rstar_pipelines.llm.coroutines import (
    BYTES_PER_TOKEN,
    OPEN_MEMORY_MB,
    Ask,
    Batch,
    Coroutine,
    Fork,
    memory_bound,
    run_coroutines,
)
from rstar_pipelines.llm.types import LLM, Completion, SamplingParams
from rstar_sandbox import Job, Sandbox

from .format import (
    ParsedCall,
    parse_tool_calls,
    render_result,
    render_tool_responses,
    truncate_middle,
)

__all__ = ["FinishReason", "RolloutConfig", "ToolCall", "Trajectory", "run_rollouts"]

FinishReason = Literal["answer", "max_turns", "length"]


class RolloutConfig(BaseModel):
    """Every limit of a rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(5, ge=1, description="most assistant turns of a trajectory")
    max_response_tokens: int = Field(
        1024, ge=1, description="most model tokens of a trajectory, all its turns together"
    )
    max_turn_tokens: int | None = Field(
        None, ge=1, description="most tokens of one assistant turn (None: what the budget has left)"
    )
    max_tool_response_chars: int = Field(
        1024,
        ge=1,
        description="tool responses are middle-truncated to this many characters; verl's default "
        "of 256 (which rStar2 keeps) cuts most tracebacks, so ours is larger",
    )
    all_tool_calls: bool = Field(
        True,
        description="run every call of a turn; False reproduces the reference, which runs only "
        "the first (the others get no response and are not recorded)",
    )
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    timeout_s: float = Field(4.0, gt=0.0, description="time limit of one tool call")
    memory_mb: int = Field(256, ge=1, description="memory limit of one tool call")


@dataclass
class ToolCall:
    """A call the model got a response to."""

    code: str
    stdin: str
    status: str | None  # the sandbox's status ("ok", "runtime_error", ...); None: did not parse
    output: str  # the tool response the model read (truncated)


@dataclass
class Trajectory:
    prompt: list[dict]  # the system and user messages the rollout started from
    # The rollout's turns: assistant and user (tool responses) alternating, ending with assistant.
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    completion_tokens: int = 0  # model tokens over all turns
    finish_reason: FinishReason | None = None  # None only while the rollout runs

    @property
    def final_text(self) -> str:
        """The last assistant turn."""
        return self.messages[-1]["content"]


@dataclass
class _Live:
    trajectory: Trajectory
    answered: int = 0  # calls answered by its last user turn (undone if the next turn is cut)


# A message's dict and a tool call's parsed fields.
MESSAGE_OVERHEAD_BYTES = 1024


def group_bytes(config: RolloutConfig, n: int) -> int:
    """The most one prompt's `n` trajectories hold while they run: each one's model tokens at
    its budget and a tool response per turn at its cap, twice (its messages, and the prompt in
    flight that carries them; the problem's own messages aside)."""
    turns = config.max_turns * (config.max_tool_response_chars + 2 * MESSAGE_OVERHEAD_BYTES)
    return n * 2 * (config.max_response_tokens * BYTES_PER_TOKEN + turns)


def run_rollouts(
    llm: LLM,
    sandbox: Sandbox,
    prompts: Sequence[Sequence[dict]],
    n: int,
    config: RolloutConfig,
    seed: int | None = None,
    on_done: Callable[[int, list[Trajectory], float], None] | None = None,
    memory_mb: float = OPEN_MEMORY_MB,
) -> list[list[Trajectory]]:
    """`n` trajectories per prompt (chat messages ending with the user's problem), in order;
    `on_done(i, trajectories, seconds)` as soon as prompt i's have all ended, with its share
    of the wall time (llm.coroutines.Window). Prompts start as the LLM has room for them, at
    most as many at once as `memory_mb` holds (`group_bytes`).

    Turn t samples with seed `seed + t`, so the same seed gives the same rollouts.
    """
    if n < 1:
        raise ValueError(f"n (rollouts per prompt) must be at least 1, got {n}")
    for index, prompt in enumerate(prompts):
        if not prompt or isinstance(prompt, str) or prompt[-1].get("role") != "user":
            raise ValueError(f"prompt {index} must be chat messages ending with a user message")
    groups = [[Trajectory(prompt=[dict(m) for m in p]) for _ in range(n)] for p in prompts]
    rollout = _Rollout(llm.name, config, seed)
    run_coroutines(
        llm,
        [rollout.group(g) for g in groups],
        {"tools": sandbox.run},
        None if on_done is None else lambda i, seconds: on_done(i, groups[i], seconds),
        window=memory_bound(group_bytes(config, n), memory_mb),
    )
    return groups


class _Rollout:
    """A prompt's first turn (its `n` samples in one request), then each trajectory on its own."""

    def __init__(self, llm_name: str, config: RolloutConfig, seed: int | None):
        self.llm_name, self.config, self.seed = llm_name, config, seed
        self.cap = min(config.max_turn_tokens or config.max_response_tokens,
                       config.max_response_tokens)  # fmt: skip

    def ask(self, messages: list[dict], turn: int, n: int, spent: int) -> Ask:
        budget_left = self.config.max_response_tokens - spent
        params = SamplingParams(
            n=n,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            max_tokens=min(self.config.max_turn_tokens or budget_left, budget_left),
            seed=None if self.seed is None else self.seed + turn,
        )
        return Ask(messages, params, stretch=True)

    def group(self, trajectories: list[Trajectory]) -> Coroutine:
        first = yield self.ask(trajectories[0].prompt, 0, len(trajectories), 0)
        if len(first) != len(trajectories):
            raise RuntimeError(
                f"LLM {self.llm_name!r} returned {len(first)} completions for {len(trajectories)}"
            )
        yield Fork([self.trajectory(t, c) for t, c in zip(trajectories, first, strict=True)])

    def trajectory(self, trajectory: Trajectory, completion: Completion) -> Coroutine:
        state = _Live(trajectory)
        for turn in range(self.config.max_turns):
            if completion.completion_tokens > self.cap:
                raise RuntimeError(
                    f"LLM {self.llm_name!r} generated {completion.completion_tokens} tokens "
                    f"with max_tokens={self.cap}"
                )
            calls = _take_turn(state, completion, turn, self.config)
            if not calls:
                return
            yield from _answer_calls(state, calls, self.config)
            chat = [*trajectory.prompt, *trajectory.messages]
            [completion] = yield self.ask(chat, turn + 1, 1, trajectory.completion_tokens)


def _take_turn(
    state: _Live, completion: Completion, turn: int, config: RolloutConfig
) -> list[ParsedCall]:
    """Record one assistant turn; the calls to answer, or [] once the trajectory is finished."""
    trajectory = state.trajectory
    if trajectory.completion_tokens + completion.completion_tokens > config.max_response_tokens:
        # Longer than this trajectory's budget left (see the module docstring); only possible
        # after a tool-response turn, since the first turn's limit is the whole budget.
        trajectory.messages.pop()
        del trajectory.tool_calls[len(trajectory.tool_calls) - state.answered :]
        trajectory.finish_reason = "length"
        return []
    trajectory.messages.append({"role": "assistant", "content": completion.text})
    trajectory.completion_tokens += completion.completion_tokens
    calls = parse_tool_calls(completion.text)
    if completion.finish_reason == "length":
        trajectory.finish_reason = "length"
    elif not calls:
        trajectory.finish_reason = "answer"
    elif turn + 1 == config.max_turns:
        trajectory.finish_reason = "max_turns"
    elif trajectory.completion_tokens >= config.max_response_tokens:
        trajectory.finish_reason = "length"
    else:
        return calls if config.all_tool_calls else calls[:1]
    return []


def _answer_calls(state: _Live, calls: list[ParsedCall], config: RolloutConfig) -> Coroutine:
    """Run every parsed call of this turn in the tools lane (one sandbox run with the other
    trajectories' calls waiting then); append the responses as one user turn."""
    jobs = [
        Job(code=c.code, stdin=c.stdin, timeout_s=config.timeout_s, memory_mb=config.memory_mb)
        for c in calls
        if c.error is None
    ]
    results = iter((yield Batch("tools", jobs)) if jobs else [])
    outputs = []
    for call in calls:
        if call.error is None:
            result = next(results)
            status, text = result.status, render_result(result)
        else:
            status, text = None, call.error
        output = truncate_middle(text, config.max_tool_response_chars)
        state.trajectory.tool_calls.append(ToolCall(call.code, call.stdin, status, output))
        outputs.append(output)
    state.trajectory.messages.append({"role": "user", "content": render_tool_responses(outputs)})
    state.answered = len(calls)
