"""Block selection (`select_blocks`) on hand-worked cases, and the K-compression cache against
compressing the whole key sequence at once."""

from __future__ import annotations

import math

import pytest
import torch

from rstar_kernels.cache import CompressedKeyCache
from rstar_kernels.gate import AttnGate, GateConfig
from rstar_kernels.selection import DEBUG_ENV, select_blocks

BS = 16


def rows(indices: torch.Tensor) -> list:
    assert indices.dtype == torch.int32
    return indices.tolist()


# -- select_blocks --


def test_budget_keeps_current_first_and_top_k_of_the_others():
    # Blocks 0..5 complete, block 6 (current) partial and unscored.
    logits = torch.tensor([[[9.0, 1, 5, 3, 4, 0], [0.0, 7, 2, 8, 1, 3]]])
    got = select_blocks(logits, 7, 0, token_budget=2 * BS + 5, block_size=BS)
    # Budget 2 blocks among 1..5 (block 0 is forced anyway), sorted descending.
    assert rows(got) == [[[6, 4, 2, 0], [6, 3, 1, 0]]]


def test_budget_when_the_current_block_is_complete():
    # The new token completed block 5: it is scored but forced, never a candidate.
    logits = torch.tensor([[[0.0, 1, 2, 3, 4, 99]]])
    got = select_blocks(logits, 6, 0, token_budget=BS, block_size=BS)
    assert rows(got) == [[[5, 4, 0]]]


def test_budget_larger_than_the_context_keeps_everything_and_pads():
    logits = torch.randn(2, 3, 4)
    got = select_blocks(logits, 5, 0, token_budget=10 * BS, block_size=BS)
    assert got.shape == (2, 3, 12)
    assert rows(got) == [[[4, 3, 2, 1, 0] + [-1] * 7] * 3] * 2


def test_zero_budget_keeps_only_the_forced_blocks():
    got = select_blocks(torch.randn(1, 2, 6), 7, 2, token_budget=BS - 1, block_size=BS)
    assert rows(got) == [[[6, 2], [6, 2]]]


def test_left_padding_excludes_blocks_before_the_first_valid_one():
    # Row 0 starts in block 2, row 1 in block 0; padding blocks score highest to be tempting.
    logits = torch.tensor([[[50.0, 40, 1, 3, 2]], [[0.0, 4, 1, 3, 2]]])
    got = select_blocks(
        logits, torch.tensor([6, 6]), torch.tensor([2, 0]), token_budget=2 * BS, block_size=BS
    )
    assert rows(got) == [[[5, 4, 3, 2]], [[5, 3, 1, 0]]]


def test_blocks_scored_minus_infinity_are_never_picked():
    logits = torch.tensor([[[0.0, -math.inf, -math.inf, 1.0]]])
    got = select_blocks(logits, 5, 0, token_budget=3 * BS, block_size=BS)
    assert rows(got) == [[[4, 3, 0, -1, -1]]]


def test_threshold_on_the_softmax_over_the_candidates():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().view(1, 1, 5)
    got = select_blocks(logits, 6, 0, threshold=0.08, block_size=BS)
    assert got.shape == (1, 1, 7)  # N + 2
    assert rows(got) == [[[5, 2, 1, 0, -1, -1, -1]]]
    # From block 1 on, the softmax renormalises over blocks 1..4: 0.6, 0.2, 0.12, 0.08.
    got = select_blocks(logits, 6, 1, threshold=0.1, block_size=BS)
    assert rows(got) == [[[5, 3, 2, 1, -1, -1, -1]]]
    # Threshold 0 keeps every candidate: dense over the valid blocks.
    got = select_blocks(logits, 6, 1, threshold=0.0, block_size=BS)
    assert rows(got) == [[[5, 4, 3, 2, 1, -1, -1]]]


def test_threshold_with_a_single_block():
    got = select_blocks(torch.zeros(2, 1, 0), 1, 0, threshold=0.5, block_size=BS)
    assert rows(got) == [[[0, -1]], [[0, -1]]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"token_budget": 64, "threshold": 0.1}, "exactly one"),
        ({"token_budget": -1}, "token_budget"),
        ({"threshold": 1.0}, "threshold"),
        ({"token_budget": 64, "num_blocks": 9}, "num_blocks"),
        ({"token_budget": 64, "first_block": 7}, "first_block"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {"num_blocks": 7, "first_block": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        select_blocks(torch.zeros(1, 1, 6), block_size=BS, **args)


def test_per_row_tensors_are_checked_only_in_debug_mode(monkeypatch):
    """Checking [B] tensors reads them back on the host (a GPU sync): only with the debug flag."""
    total = torch.tensor([9])
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    got = select_blocks(torch.zeros(1, 1, 6), total, 0, token_budget=64, block_size=BS)
    assert got.shape == (1, 1, 64 // BS + 2)
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="num_blocks must be in"):
        select_blocks(torch.zeros(1, 1, 6), total, 0, token_budget=64, block_size=BS)


# -- CompressedKeyCache --


@pytest.fixture(scope="module")
def gate() -> AttnGate:
    torch.manual_seed(0)
    config = GateConfig(
        family="llama",
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        block_size=8,
        gate_dim=16,
    )
    return AttnGate(config).eval()


def left_padded(batch_pads: list[int], length: int):
    """Random pre-RoPE keys, validity and generate()-style position ids of a left-padded batch."""
    k = torch.randn(len(batch_pads), 2, length, 16)
    starts = torch.tensor(batch_pads)
    t = torch.arange(length)
    valid = t >= starts[:, None]
    positions = (t - starts[:, None]).clamp(min=0)
    return k, valid, positions, starts


def expected_keys(gate, k, starts, length):
    """The whole sequence compressed at once; each block rotated to its first valid token's
    position, worked out per block from the row's start."""
    bs = gate.config.block_size
    blocks = length // bs
    t = torch.arange(blocks * bs)
    valid = t >= starts[:, None]
    first = torch.maximum(torch.arange(blocks) * bs, starts[:, None])
    block_valid = first < (torch.arange(blocks) + 1) * bs
    block_pos = torch.where(block_valid, first - starts[:, None], 0)
    pooled = gate.pool(k[:, :, : blocks * bs], valid)
    return gate.keys(pooled, block_pos), block_valid


@torch.no_grad()
@pytest.mark.parametrize("prompt", [13, 5, 16])
def test_cache_after_decode_steps_equals_compressing_everything(gate, prompt):
    length = 45  # crosses blocks 2..5 while decoding
    pads = [0, 3, 11] if prompt > 11 else [0, 2, 4]
    k, valid, positions, starts = left_padded(pads, length)
    cache = CompressedKeyCache(gate)
    cache.prefill(k[:, :, :prompt], valid[:, :prompt], positions[:, :prompt])
    for t in range(prompt, length + 1):
        if t > prompt:
            cache.append(k[:, :, t - 1 : t], positions[:, t - 1])
        want, want_valid = expected_keys(gate, k, starts, t)
        assert cache.length == t
        assert cache.num_complete == t // 8
        assert torch.equal(cache.block_valid, want_valid)
        torch.testing.assert_close(cache.keys, want, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_cache_rows_repeated_for_samples_follow_the_repeated_sequence(gate):
    k, valid, positions, starts = left_padded([0, 6], 30)
    cache = CompressedKeyCache(gate)
    cache.prefill(k[:, :, :10], valid[:, :10], positions[:, :10])
    cache.batch_repeat_interleave(3)
    k, positions, starts = (x.repeat_interleave(3, dim=0) for x in (k, positions, starts))
    for t in range(10, 30):
        cache.append(k[:, :, t : t + 1], positions[:, t])
    want, want_valid = expected_keys(gate, k, starts, 30)
    assert torch.equal(cache.block_valid, want_valid)
    torch.testing.assert_close(cache.keys, want, atol=1e-6, rtol=1e-5)


def test_cache_refuses_a_step_before_prefill_and_misshapen_keys(gate):
    cache = CompressedKeyCache(gate)
    with pytest.raises(RuntimeError, match="before prefill"):
        cache.append(torch.zeros(1, 2, 1, 16), torch.zeros(1))
    cache.prefill(torch.zeros(1, 2, 4, 16))
    with pytest.raises(ValueError, match="k_step"):
        cache.append(torch.zeros(1, 2, 2, 16), torch.zeros(1))
    with pytest.raises(ValueError, match="valid"):
        cache.prefill(torch.zeros(1, 2, 4, 16), torch.ones(1, 3, dtype=torch.bool))
