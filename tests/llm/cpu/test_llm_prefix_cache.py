"""The transformers backend's store of prompt prefixes (module `prefix_cache`), on plain
tensors: lookups by longest common prefix, replacement of extended entries, the byte limit."""

from __future__ import annotations

import pytest
import torch

from rstar_pipelines.llm.cpu.decode_loop import MIN_SHARED_PREFIX
from rstar_pipelines.llm.cpu.prefix_cache import PrefixCache


def states(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values [1, 1, L, 1] that record each position's token."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    return [(column + layer, column - layer) for layer in range(layers)]


PREAMBLE = list(range(100, 100 + MIN_SHARED_PREFIX))


def test_the_longest_common_prefix_is_found_and_extended_entries_are_replaced():
    store = PrefixCache()
    store.put([*PREAMBLE, 1, 2, 3], states([*PREAMBLE, 1, 2, 3]))
    store.put([*PREAMBLE, 7, 8], states([*PREAMBLE, 7, 8]))
    length, found = store.longest([*PREAMBLE, 1, 2, 9, 9])
    assert length == len(PREAMBLE) + 2
    assert found[1][0][0, 0, :length, 0].tolist() == [t + 1 for t in [*PREAMBLE, 1, 2]]
    store.put([*PREAMBLE, 1, 2, 3, 4], states([*PREAMBLE, 1, 2, 3, 4]))
    assert len(store) == 2  # it replaced the entry it extends, not the branch beside it
    assert store.longest([*PREAMBLE, 7, 8, 5])[0] == len(PREAMBLE) + 2


def test_too_short_a_match_is_no_match():
    store = PrefixCache()
    store.put(PREAMBLE, states(PREAMBLE))
    assert store.longest([*PREAMBLE[:-1], 0]) == (0, None)
    assert store.longest([5, 6, 7]) == (0, None)


def test_the_least_recently_used_entries_go_past_the_byte_limit():
    one = 2 * 2 * len([*PREAMBLE, 0]) * 4  # layers x (keys, values) x positions x float32
    store = PrefixCache(max_bytes=2 * one)
    a, b, c = ([*PREAMBLE, n] for n in (1, 2, 3))
    store.put(a, states(a))
    store.put(b, states(b))
    store.longest(a)  # a is used again, so b is now the oldest
    store.put(c, states(c))
    assert store.stored_bytes == 2 * one
    assert store.longest(b)[0] == len(PREAMBLE)  # only a's or c's preamble is left of b
    assert store.longest(a)[0] == len(a) and store.longest(c)[0] == len(c)
    store.put(PREAMBLE * 3, states(PREAMBLE * 3))  # larger than the whole store: not kept
    assert len(store) == 2


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)
