"""The preallocated key/value cache against transformers' DynamicLayer, operation by operation."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MistralConfig
from transformers.cache_utils import DynamicLayer

from rstar_pipelines.llm.kv_cache import PreallocatedLayer, preallocated_cache


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
