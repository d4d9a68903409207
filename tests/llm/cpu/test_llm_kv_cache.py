"""The preallocated key/value cache against transformers' DynamicLayer, operation by operation."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MistralConfig
from transformers.cache_utils import DynamicLayer

from rstar_pipelines.llm.cpu.kv_cache import PreallocatedLayer, preallocated_cache


def states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=gen), torch.randn(
        batch, 2, length, 4, generator=gen
    )


def assert_same(ours: PreallocatedLayer, theirs: DynamicLayer) -> None:
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert ours.get_seq_length() == theirs.get_seq_length()


def test_appends_in_place_and_equals_a_dynamic_layer_through_every_operation():
    ours, theirs = PreallocatedLayer(capacity=12), DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*states(2, 5, seed=0))
    assert_same(ours, theirs)
    buffer = ours.keys.data_ptr()
    for step in range(3):
        got = ours.update(*states(2, 1, seed=1 + step))
        want = theirs.update(*states(2, 1, seed=1 + step))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.keys.data_ptr() == buffer  # no copy of the cache while it fits
    for layer in (ours, theirs):
        layer.crop(-2)
        layer.update(*states(2, 1, seed=9))
    assert_same(ours, theirs)
    for layer in (ours, theirs):
        layer.batch_repeat_interleave(3)
        layer.update(*states(6, 1, seed=10))
    assert_same(ours, theirs)
    for layer in (ours, theirs):
        layer.batch_select_indices(torch.tensor([0, 4]))
        layer.update(*states(2, 1, seed=11))
    assert_same(ours, theirs)
    # Past the planned capacity (12) it still appends correctly, into a bigger buffer.
    for layer in (ours, theirs):
        layer.update(*states(2, 9, seed=12))
    assert_same(ours, theirs)
    assert ours.get_seq_length() == 18


def test_reset_starts_over():
    layer = PreallocatedLayer(capacity=8)
    layer.update(*states(1, 3, seed=0))
    layer.reset()
    keys, values = states(1, 2, seed=1)
    got_keys, got_values = layer.update(keys, values)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_only_full_attention_layers_are_replaced():
    full = preallocated_cache(LlamaConfig(num_hidden_layers=2), capacity=16)
    assert all(type(layer) is PreallocatedLayer for layer in full.layers)
    sliding = preallocated_cache(MistralConfig(num_hidden_layers=2, sliding_window=4), 16)
    assert not any(type(layer) is PreallocatedLayer for layer in sliding.layers)


def held(layer: PreallocatedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row of `layer` attends: its group's shared part, then its own."""
    if layer.shared_keys is None:
        return layer.keys, layer.values
    rows = layer.groups.group_of_row
    return (
        torch.cat([layer.shared_keys[rows], layer.keys], dim=-2),
        torch.cat([layer.shared_values[rows], layer.values], dim=-2),
    )


def test_repeated_rows_share_what_they_held_and_attend_what_a_dynamic_layer_holds():
    ours, theirs = PreallocatedLayer(capacity=20, share_repeats=True), DynamicLayer()
    # A preamble for 1 row, repeated for 3 prompts, their rests, then 2 samples of each.
    steps = [("update", 1, 4), ("repeat", 3), ("update", 3, 2), ("repeat", 2), ("update", 6, 1)]
    steps += [
        ("select", [0, 1, 3, 4, 5]),
        ("update", 5, 1),
        ("select", [2, 3, 4]),
        ("update", 3, 1),
    ]
    for seed, (op, *args) in enumerate(steps):
        for layer in (ours, theirs):
            if op == "update":
                layer.update(*states(*args, seed=seed))
            elif op == "repeat":
                layer.batch_repeat_interleave(*args)
            else:
                layer.batch_select_indices(torch.tensor(args[0]))
        keys, values = held(ours)
        assert torch.equal(keys, theirs.keys) and torch.equal(values, theirs.values), (op, args)
        assert ours.get_seq_length() == theirs.get_seq_length()
    # One copy of each prompt's 6 tokens is kept, for the prompts that still have rows: the
    # rows left are the 2nd prompt's second sample and both of the 3rd's.
    assert ours.shared_keys.shape[:3] == (2, 2, 6)
    assert ours.groups.group_of_row.tolist() == [0, 1, 1]
    assert ours.own_length() == 3
