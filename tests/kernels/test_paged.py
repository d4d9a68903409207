"""The paged decode path (vLLM's cache layout) against the contiguous one built from the same
keys: compressed gate keys, selected blocks and attention output must agree."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rstar_kernels import sparse_decode_reference
from rstar_kernels.cache import CompressedKeyCache
from rstar_kernels.gate import GateConfig, SeerGates
from rstar_kernels.paged import HeadRotary, PagedGateKeys, gather_selected, paged_sparse_decode
from rstar_kernels.selection import select_blocks

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 16


def _model_config(rope_scaling=None):
    config = LlamaConfig(
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=1,
        max_position_embeddings=1024,
    )
    if rope_scaling:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    return config


def _rotate(model_config, x, positions):
    """Post-RoPE x [B, H, L, D] by transformers' own Llama RoPE."""
    cos, sin = LlamaRotaryEmbedding(model_config)(x, positions)
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def _paged(cache, seq_lens, pages_per_row, num_pages, generator):
    """Scatter contiguous [B, H_kv, L, D] into pages [num_pages, b, H_kv, D] at random pages."""
    batch = cache.shape[0]
    table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_row]
    table = table.view(batch, pages_per_row).to(torch.int32)
    paged = torch.full((num_pages, BLOCK, KV_HEADS, DIM), float("nan"))
    for row in range(batch):
        for block in range(-(-int(seq_lens[row]) // BLOCK)):
            end = min((block + 1) * BLOCK, int(seq_lens[row]))
            chunk = cache[row, :, block * BLOCK : end].transpose(0, 1)
            paged[table[row, block], : end - block * BLOCK] = chunk
    return paged, table


@pytest.mark.parametrize("mode", [{"token_budget": 2 * BLOCK}, {"threshold": 0.05}])
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_paged_decode_matches_contiguous(mode, rope_scaling):
    generator = torch.Generator().manual_seed(0)
    model_config = _model_config(rope_scaling)
    config = GateConfig.for_model(model_config, block_size=BLOCK, gate_dim=16)
    gate = SeerGates(config)[0]
    seq_lens = torch.tensor([7 * BLOCK + 5, 4 * BLOCK, 1], dtype=torch.int32)
    length = int(seq_lens.max())
    batch = len(seq_lens)
    positions = torch.arange(length).expand(batch, length)
    k_pre = torch.randn(batch, KV_HEADS, length, DIM, generator=generator)
    v = torch.randn(batch, KV_HEADS, length, DIM, generator=generator)
    q_pre = torch.randn(batch, HEADS, DIM, generator=generator)
    k_post = _rotate(model_config, k_pre, positions)
    q_post = torch.stack(
        [
            _rotate(model_config, q_pre[i : i + 1, :, None], (seq_lens[i : i + 1, None] - 1))[
                0, :, 0
            ]
            for i in range(batch)
        ]
    )

    # Contiguous: what the transformers path computes (no padding here).
    expected_indices = []
    for row in range(batch):
        n = int(seq_lens[row])
        cache = CompressedKeyCache(gate)
        cache.prefill(k_pre[row : row + 1, :, :n])
        gq = gate.query(q_pre[row : row + 1, :, None], torch.tensor([[n - 1]]))
        logits = gate.logits(gq, cache.keys)[:, :, 0]
        expected_indices.append(select_blocks(logits, -(-n // BLOCK), 0, block_size=BLOCK, **mode))
    width = max(i.shape[-1] for i in expected_indices)
    padded = [
        torch.nn.functional.pad(i, (0, width - i.shape[-1]), value=-1) for i in expected_indices
    ]
    expected = sparse_decode_reference(q_post, k_post, v, torch.cat(padded), seq_lens, BLOCK)

    key_cache, table = _paged(k_post, seq_lens, 8, 40, generator)
    value_cache, _ = _paged(v, seq_lens, 8, 40, generator.manual_seed(0))
    value_cache = torch.full_like(value_cache, float("nan"))
    for row in range(batch):  # same pages as the keys
        for block in range(-(-int(seq_lens[row]) // BLOCK)):
            end = min((block + 1) * BLOCK, int(seq_lens[row]))
            value_cache[table[row, block], : end - block * BLOCK] = v[
                row, :, block * BLOCK : end
            ].transpose(0, 1)
    gate_keys = PagedGateKeys(gate, 40, "cpu")
    out = paged_sparse_decode(
        gate,
        gate_keys,
        HeadRotary(config),
        q_post,
        key_cache,
        value_cache,
        table,
        seq_lens,
        backend="torch",
        **mode,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # The compressed keys of row 0's full pages equal the contiguous cache's.
    cache = CompressedKeyCache(gate)
    cache.prefill(k_pre[:1, :, : int(seq_lens[0])])
    full = int(seq_lens[0]) // BLOCK
    torch.testing.assert_close(
        gate_keys.keys[table[0, :full].long()].transpose(0, 1), cache.keys[0], atol=1e-4, rtol=1e-4
    )


def test_written_pages_are_compressed_again():
    generator = torch.Generator().manual_seed(1)
    config = GateConfig.for_model(_model_config(), block_size=BLOCK, gate_dim=16)
    gate = SeerGates(config)[0]
    rotary = HeadRotary(config)
    key_cache = torch.randn(6, BLOCK, KV_HEADS, DIM, generator=generator)
    table = torch.tensor([[3, 1, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([2 * BLOCK + 3], dtype=torch.int32)
    gate_keys = PagedGateKeys(gate, 6, "cpu")
    gate_keys.refresh(key_cache, table, seq_lens, rotary)
    assert gate_keys.fresh.tolist() == [False, True, False, True, False, False]  # page 4: partial
    before = gate_keys.keys[1].clone()
    key_cache[1] = torch.randn(BLOCK, KV_HEADS, DIM, generator=generator)
    gate_keys.refresh(key_cache, table, seq_lens, rotary)
    assert torch.equal(gate_keys.keys[1], before)  # vLLM did not say it wrote page 1
    gate_keys.mark_written(torch.tensor([1 * BLOCK + 5, -1]))
    gate_keys.refresh(key_cache, table, seq_lens, rotary)
    assert not torch.allclose(gate_keys.keys[1], before)


def test_gather_puts_the_partial_block_first_and_masks_its_head():
    key_cache = (
        torch.arange(4 * BLOCK, dtype=torch.float)
        .view(4, BLOCK, 1, 1)
        .expand(4, BLOCK, KV_HEADS, 1)
    )
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([2 * BLOCK + 3], dtype=torch.int32)
    indices = torch.tensor([[[2, 0, -1], [2, 1, -1]]], dtype=torch.int32)
    k, _, slots, seqlens, starts = gather_selected(key_cache, key_cache, table, seq_lens, indices)
    assert starts.tolist() == [BLOCK - 3] and seqlens.tolist() == [3 * BLOCK]
    assert slots.tolist() == [[[0, 1, -1], [0, 1, -1]]]
    # slot 0 ends with the current block's 3 tokens (page 3, offsets 0..2)
    assert k[0, 0, BLOCK - 3 : BLOCK, 0].tolist() == [3 * BLOCK + t for t in range(3)]
    assert k[0, 0, BLOCK : 2 * BLOCK, 0].tolist() == [2 * BLOCK + t for t in range(BLOCK)]
    assert k[0, 1, BLOCK : 2 * BLOCK, 0].tolist() == [0 * BLOCK + t for t in range(BLOCK)]


def test_page_size_must_equal_the_block_size():
    config = GateConfig.for_model(_model_config(), block_size=BLOCK, gate_dim=16)
    gate = SeerGates(config)[0]
    cache = torch.zeros(2, 2 * BLOCK, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="block_size=16"):
        paged_sparse_decode(
            gate,
            PagedGateKeys(gate, 2, "cpu"),
            HeadRotary(config),
            torch.zeros(1, HEADS, DIM),
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([3]),
            token_budget=BLOCK,
            backend="torch",
        )
