"""Keys and values of prompt prefixes kept between the transformers backend's generate() calls.

Successive calls of a stage share long prompt prefixes: an MCTS expansion's prompt is the last
expansion's prompt of its tree plus one step, a DSER round or an agent's next turn extends the
previous prompt, and every prompt of a stage starts with the same few-shot preamble. Each call
prefilled all of it again: in the demo's search, about a third of a 4-sample call over an
800-token prompt (docs/benchmarks.md, "Prefix cache"). `PrefixCache` keeps the key/value cache
of every batch's shared prefix (the leading tokens its prompts have in common, a lone prompt's
tokens but the last: `decode_loop.shared_prefix_length`), and a later batch whose shared prefix
starts with stored tokens takes them and computes only the rest, as vLLM's automatic prefix
caching does across requests.

An entry is one token sequence with its keys and values in every layer; a lookup takes the entry
with the longest common prefix (so a stored tree path serves any prompt that branches off it
after `MIN_SHARED_PREFIX` tokens), an entry that a new one extends is replaced by it, and the
least recently used entries go once the store holds more than `max_bytes`. Keys and values at a
position depend only on the tokens up to it (causal attention), so a reused prefix equals its
prefill up to the float rounding of computing it in two pieces. Only a model whose weights do
not change holds one: a model being trained (`TransformersLLM.wrap`) has none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .decode_loop import MIN_SHARED_PREFIX, common_prefix_length

# One store per loaded model: 512 MiB is about 11,000 tokens of the embedded model's cache
# (45 KiB a token in float32), the demo search's eight open tree paths (about 6,400 tokens)
# with room to spare.
DEFAULT_MAX_BYTES = 512 * 2**20

LayerStates = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, L, D]


class PrefixCache:
    """Stored prefixes of one model (module docstring); safe to share between threads."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], LayerStates] = OrderedDict()
        self._sizes: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()
        # What the store saved and what was computed anyway, in prefix tokens.
        self.reused_tokens = 0
        self.computed_tokens = 0

    @property
    def stored_bytes(self) -> int:
        return sum(self._sizes.values())

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, tokens: Sequence[int]) -> tuple[int, LayerStates | None]:
        """(n, states): the most leading tokens of `tokens` that one entry holds (at least
        MIN_SHARED_PREFIX) and that entry's keys and values, whose first n positions are those
        tokens'; (0, None) when no entry holds that many."""
        best, found = 0, None
        with self._lock:
            for stored in self._entries:
                length = common_prefix_length(stored, tokens)
                if length > best:
                    best, found = length, stored
            if found is None or best < MIN_SHARED_PREFIX:
                return 0, None
            self._entries.move_to_end(found)
            return best, self._entries[found]

    def put(self, tokens: Sequence[int], states: LayerStates) -> None:
        """Store the keys and values of `tokens` (each [1, H, len(tokens), D], owned by the
        store from now on), replacing the entries it extends."""
        key = tuple(tokens)
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in states)
        if size > self.max_bytes:
            return
        with self._lock:
            for stored in [s for s in self._entries if key[: len(s)] == s]:
                self._drop(stored)
            self._entries[key] = states
            self._sizes[key] = size
            while self.stored_bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()

    def count(self, reused: int, computed: int) -> None:
        with self._lock:
            self.reused_tokens += reused
            self.computed_tokens += computed

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        del self._sizes[key]
