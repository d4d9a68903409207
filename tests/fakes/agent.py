"""The scripted rStar2-Agent policy and the tool-call text it writes."""

from __future__ import annotations

import json

from rstar_pipelines.llm import Prompt, SamplingParams
from tests.fakes.llm import ScriptedLLM


def call(code: str, stdin: str | None = None) -> str:
    """A python tool call as the agent writes it."""
    arguments = {"code": code} if stdin is None else {"code": code, "input": stdin}
    return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': arguments})}\n</tool_call>"


def response(*outputs: str) -> str:
    """The tool responses of one turn, as the rollout puts them in the next user message."""
    return "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in outputs)


class AgentPolicy(ScriptedLLM):
    """Replies by the first rule (marker, replies) whose marker is in the conversation's last
    message: `params.n` replies, cycled when there are fewer. One token per character; a reply
    longer than max_tokens is cut there, as a model's would be."""

    def __init__(self, rules: list[tuple[str, list[str]]]):
        super().__init__(cycle=True, prompt_tokens=0, truncate=True)
        self.rules = rules

    def reply(self, prompt: Prompt, params: SamplingParams) -> list[str]:
        last = prompt[-1]
        assert last["role"] == "user", "a turn always starts after a user message"
        for marker, replies in self.rules:
            if marker in last["content"]:
                return replies
        raise AssertionError(f"no rule for {last['content']!r}")
