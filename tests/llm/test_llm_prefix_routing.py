"""Prefix affinity over a fleet: prompts that share a prefix go to the server that was sent it,
while load comes first."""

from __future__ import annotations

import time
from contextlib import closing

from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.llm.prefix_routing import BLOCK_CHARS, PrefixIndex, prefix_keys
from tests.fakes.openai_server import CannedServer, ScriptedOpenAIServer

SAMPLED = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=0)


def test_a_key_stands_for_the_whole_prefix_up_to_its_block():
    shared = "x" * (2 * BLOCK_CHARS)
    a, b = prefix_keys(shared + "a" * BLOCK_CHARS), prefix_keys(shared + "b" * BLOCK_CHARS)
    assert a[:2] == b[:2] and a[2] != b[2]
    # the same block after a different prefix is another key
    assert prefix_keys("y" * BLOCK_CHARS + "z" * BLOCK_CHARS)[1] != prefix_keys("z" * 512)[1]
    assert prefix_keys("x" * (BLOCK_CHARS - 1)) == []  # only whole blocks
    chat = [{"role": "user", "content": "q" * BLOCK_CHARS}]
    continued = [*chat, {"role": "assistant", "content": "step " * BLOCK_CHARS}]
    assert prefix_keys(continued)[: len(prefix_keys(chat))] == prefix_keys(chat)


def test_the_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(max_blocks=3)
    index.add([1, 2, 3])
    assert index.matched([1, 2, 9]) == 2 and index.matched([9, 2]) == 0
    index.add([4])  # 1 goes
    assert index.matched([1, 2]) == 0 and index.matched([4]) == 1


def _until_every_server_answered(llm) -> None:
    """Until the client knows every server (its first request goes to the first that answers)."""
    llm.generate(["warm up"], SamplingParams(max_tokens=1))
    deadline = time.monotonic() + 30
    while not all(s["window"] for s in llm.server_stats().values()):
        assert time.monotonic() < deadline, llm.server_stats()
        time.sleep(0.01)


def _tree_requests(requests: list[dict]) -> list[dict]:
    return [body for body in requests if body["prompt"] != "warm up"]


def _tree_prompt(tree: int, steps: int) -> str:
    question = f"Question {tree}: " + f"what is {tree} squared? " * 40
    return question + "".join(
        f"<step {k}> let us compute it carefully.\n" * 8 for k in range(steps)
    )


def test_each_trees_prompts_go_to_one_server_and_the_trees_spread():
    servers = [ScriptedOpenAIServer(lambda prompt, sample: f"s{sample}") for _ in range(2)]
    with servers[0] as a, servers[1] as b, closing(load_llm("openai", base_url=[a, b])) as llm:
        _until_every_server_answered(llm)
        for steps in range(4):  # each round: every tree's next expansion, all at once,
            order = [(t + steps) % 6 for t in range(6)]  # in another order (load alone
            llm.generate([_tree_prompt(t, steps) for t in order], SAMPLED)  # would move them)
    trees_on = [{b["prompt"].split(":")[0] for b in _tree_requests(s.requests)} for s in servers]
    assert trees_on[0] and trees_on[1] and not trees_on[0] & trees_on[1]
    assert len(trees_on[0] | trees_on[1]) == 6


def test_a_full_server_does_not_hold_the_prompts_that_share_its_prefix():
    def slow(method, path, body):
        time.sleep(0.3)
        choices = [{"index": 0, "text": "s", "finish_reason": "stop", "token_ids": [0]}]
        return 200, {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    one = SamplingParams(n=1, temperature=0.8, max_tokens=8, seed=0)
    servers = [CannedServer(slow, owned_by="vllm"), CannedServer(slow, owned_by="vllm")]
    with servers[0] as (a, to_a), servers[1] as (b, to_b):
        llm = load_llm("openai", model="m", base_url=[a, b], max_concurrency=2)
        with closing(llm):
            _until_every_server_answered(llm)
            llm.generate([_tree_prompt(0, k) for k in range(8)], one)
    assert (
        len(_tree_requests(to_a)) == len(_tree_requests(to_b)) == 4
    )  # one tree, spread by load: two in flight on each
