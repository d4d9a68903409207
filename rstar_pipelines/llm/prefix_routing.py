"""Which server of a fleet has likely cached a prompt's prefix (docs/llm-serving.md, "Prefix
affinity").

A server with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache) prefills
only the part of a prompt it has not seen before. The samples of one expansion share their whole
prompt, and the successive expansions of one search tree share the question and every step
before the last: sent to whichever replica is least loaded, each shared prefix is prefilled once
per replica instead of once. So among the servers with room and about equally loaded, a request
goes to the one that was sent the longest prefix of its prompt (as SGLang's cache-aware router
does), and load decides the rest.

The client does not see the servers' caches: it remembers what it sent. A prompt is cut into
blocks of `BLOCK_CHARS` characters, and each block's key chains the previous one's (as vLLM keys
its cache blocks), so one key stands for the whole prefix up to its block's end; each server
keeps the most recent `MAX_BLOCKS` keys sent to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .types import Prompt, is_chat

BLOCK_CHARS = 256
# About 16M characters of prompts a server: more than a replica's cache holds of most models.
MAX_BLOCKS = 65536
# A server fuller than the least loaded one by more than this share of its window gets no
# request for its cache's sake: load first, the cache among servers about equally loaded.
LOAD_SLACK = 0.25


def prompt_text(prompt: Prompt) -> str:
    """The prompt as one string in the order the server reads it: a chat prompt's messages,
    each as its role and content, in turn."""
    if not is_chat(prompt):
        return prompt
    return "".join(f"{m['role']}\x00{m['content']}\x01" for m in prompt)


def prefix_keys(prompt: Prompt, block_chars: int = BLOCK_CHARS) -> list[int]:
    """One key per whole block of the prompt, each standing for the prefix up to its end."""
    text = prompt_text(prompt)
    keys, key = [], 0
    for end in range(block_chars, len(text) + 1, block_chars):
        key = hash((key, text[end - block_chars : end]))
        keys.append(key)
    return keys


class PrefixIndex:
    """The prefixes sent to one server, the most recent `max_blocks` blocks."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt with `keys` were sent here."""
        for count, key in enumerate(keys):
            if key not in self._blocks:
                return count
        return len(keys)

    def add(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
