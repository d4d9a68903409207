"""Cascade attention (module `cascade_attention`) against SDPA over every row's whole cache.
Outputs are compared at torch's float32 tolerances: the two sum in different orders, and
SDPA's order differs from one CPU to another."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rstar_pipelines.llm.cpu import cascade_attention
from rstar_pipelines.llm.cpu.cascade_attention import CACHE_KWARG, cascade_attention_forward
from rstar_pipelines.llm.cpu.kernels import decode_attention_cpu
from rstar_pipelines.llm.cpu.kv_cache import preallocated_cache
from rstar_pipelines.llm.types import SamplingParams

HEADS, KV_HEADS, DIM = 6, 2, 64  # a head of 64: our decode kernel takes it


class Attention(torch.nn.Module):
    """What attention functions read of transformers' attention modules."""

    layer_idx = 0
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sharing_cache(prompts: int, prompt_length: int, copies: int):
    """A one-layer cache of `prompts` prompts' keys, repeated `copies` times (shared)."""
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    )
    cache = preallocated_cache(config, capacity=64, share_repeats=True)
    shape = (prompts, KV_HEADS, prompt_length, DIM)
    cache.layers[0].update(random(*shape, seed=1), random(*shape, seed=2))
    cache.batch_repeat_interleave(copies)
    return cache


def both(cache, query, new_keys, new_values, mask):
    """(cascade attention, SDPA over the whole keys) after appending the new keys."""
    layer = cache.layers[0]
    own_keys, own_values = layer.update(new_keys, new_values)
    rows = layer.groups.group_of_row
    whole_keys = torch.cat([layer.shared_keys[rows], own_keys], dim=-2)
    whole_values = torch.cat([layer.shared_values[rows], own_values], dim=-2)
    module = Attention()
    got, _ = cascade_attention_forward(
        module, query, own_keys, own_values, mask, scaling=0.3, **{CACHE_KWARG: cache}
    )
    want, _ = sdpa_attention_forward(module, query, whole_keys, whole_values, mask, scaling=0.3)
    return got, want


@pytest.mark.parametrize("drop", [[], [1, 2, 5]], ids=["every row", "uneven groups"])
def test_a_decode_step_equals_attention_over_each_rows_whole_cache(drop):
    prompts, length, copies = 3, 10, 3
    cache = sharing_cache(prompts, length, copies)
    cache.layers[0].update(random(9, KV_HEADS, 2, DIM, seed=3), random(9, KV_HEADS, 2, DIM, seed=4))
    keep = [row for row in range(prompts * copies) if row not in drop]
    cache.batch_select_indices(torch.tensor(keep))
    rows = len(keep)
    # Left padding: the first prompt's first 4 tokens, and a sample's first generated token.
    mask = torch.ones(rows, 1, 1, length + 3, dtype=torch.bool)
    mask[: copies - len([r for r in drop if r < copies]), :, :, :4] = False
    mask[-1, :, :, length] = False
    query = random(rows, HEADS, 1, DIM, seed=5)
    new = random(rows, KV_HEADS, 1, DIM, seed=6), random(rows, KV_HEADS, 1, DIM, seed=7)
    got, want = both(cache, query, *new, mask)
    torch.testing.assert_close(got, want)


def test_rows_whose_shared_part_is_all_padding_attend_only_their_own_keys():
    cache = sharing_cache(prompts=2, prompt_length=5, copies=2)
    mask = torch.ones(4, 1, 1, 6, dtype=torch.bool)
    mask[2:, :, :, :5] = False  # the second prompt is one token long: its shared part is padding
    query = random(4, HEADS, 1, DIM, seed=8)
    new = random(4, KV_HEADS, 1, DIM, seed=9), random(4, KV_HEADS, 1, DIM, seed=10)
    got, want = both(cache, query, *new, mask)
    torch.testing.assert_close(got, want)


def test_several_new_tokens_after_a_shared_preamble_attend_causally():
    # A greedy batch's preamble is shared by all its prompts, whose rests then run at once.
    cache = sharing_cache(prompts=1, prompt_length=7, copies=3)
    new_tokens = 4
    causal = torch.ones(new_tokens, new_tokens, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(new_tokens, 7, dtype=torch.bool), causal], dim=-1)
    mask = mask.expand(3, 1, new_tokens, 7 + new_tokens).clone()
    mask[0, :, :, 7] = False  # the first prompt's rest is left-padded by a token
    mask[0, :, 0, :] = False  # ... whose query attends nothing: transformers masks it whole
    query = random(3, HEADS, new_tokens, DIM, seed=11)
    new = (
        random(3, KV_HEADS, new_tokens, DIM, seed=12),
        random(3, KV_HEADS, new_tokens, DIM, seed=13),
    )
    got, want = both(cache, query, *new, mask)
    # The fully masked query's output is whatever each kernel gives such a row; the rest agree.
    torch.testing.assert_close(got[1:], want[1:])
    torch.testing.assert_close(got[0, 1:], want[0, 1:])
    assert torch.isfinite(got).all()


def test_a_cache_that_shares_nothing_gets_sdpa():
    module = Attention()
    query, keys, values = (
        random(2, n, 5, DIM, seed=s) for s, n in ((14, HEADS), (15, KV_HEADS), (16, KV_HEADS))
    )
    got, _ = cascade_attention_forward(module, query, keys, values, None, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, keys, values, None, scaling=0.3)
    assert torch.equal(got, want)


@pytest.mark.skipif(not decode_attention_cpu.KERNEL.available(), reason="needs AVX-512")
def test_a_decode_step_over_a_cache_that_shares_nothing_equals_sdpa(monkeypatch):
    # One query a row over its own keys, the first row left-padded (a boolean mask, as
    # transformers makes it): our kernel, which SDPA's result must match.
    calls = []

    def counted(*args):
        out = decode_attention_cpu.decode_attention(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cascade_attention, "decode_attention", counted)
    module = Attention()
    query, keys, values = (
        random(2, n, length, DIM, seed=s)
        for s, n, length in ((17, HEADS, 1), (18, KV_HEADS, 9), (19, KV_HEADS, 9))
    )
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False
    got, _ = cascade_attention_forward(module, query, keys, values, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=0.3)
    assert calls == [True]
    torch.testing.assert_close(got, want)


def test_sampled_completions_are_the_same_with_sdpa(embedded_fp32_llm, monkeypatch):
    # float32 weights: the merge rounds differently from one attention over the whole cache (in
    # the last bits), which bfloat16 activations could round up to a different sample.
    model = embedded_fp32_llm._model
    assert model.config._attn_implementation == cascade_attention.ATTENTION_NAME
    shared_calls = []
    shared_part = cascade_attention._shared_part
    monkeypatch.setattr(
        cascade_attention,
        "_shared_part",
        lambda *args: shared_calls.append(args[0].shape) or shared_part(*args),
    )
    preamble = "Answer the question in one short sentence, then stop. " * 6
    prompts = [preamble + "What is the capital of France?", preamble + "Why is the sky blue?"]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=4, stop=(".",))
    with_cascade = [
        embedded_fp32_llm.generate(prompts, params),
        embedded_fp32_llm.generate(prompts[:1], params),
    ]
    assert shared_calls, "no decode step read a shared part"
    model.set_attn_implementation("sdpa")
    try:
        with_sdpa = [
            embedded_fp32_llm.generate(prompts, params),
            embedded_fp32_llm.generate(prompts[:1], params),
        ]
    finally:
        model.set_attn_implementation(cascade_attention.ATTENTION_NAME)
    assert with_cascade == with_sdpa
