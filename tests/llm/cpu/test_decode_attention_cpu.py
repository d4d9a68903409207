"""The decode attention kernel (`llm.cpu.kernels.decode_attention_cpu`) against torch's CPU flash
kernel: outputs and log-sum-exps, masks, strided caches, and the inputs it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from rstar_pipelines.llm.cpu.kernels import decode_attention_cpu
from rstar_pipelines.llm.cpu.kernels.decode_attention_cpu import decode_attention

pytestmark = pytest.mark.skipif(
    not decode_attention_cpu.KERNEL.runs_here(), reason="the CPU cannot run the kernel (AVX-512)"
)


def flash(query, key, value, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=mask, scale=scale
    )


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    ("batch", "heads", "queries", "length"),
    # One key, fewer keys than a block of 16, a tail after whole blocks, every query block size.
    [(1, 1, 1, 1), (2, 3, 3, 7), (3, 3, 9, 37), (2, 1, 13, 160), (1, 2, 64, 300)],
)
def test_equals_torchs_flash_kernel(batch, heads, queries, length, dim):
    generator = torch.Generator().manual_seed(batch * 1000 + queries * 10 + length)
    query, key, value = (
        torch.randn(batch, heads, n, dim, generator=generator) for n in (queries, length, length)
    )
    mask = torch.zeros(batch, 1, 1, length)
    mask[0, ..., : length // 3] = float("-inf")  # left padding of the first entry
    for given in (None, mask):
        out, lse = decode_attention(query, key, value, given, 0.125)
        want_out, want_lse = flash(query, key, value, given, 0.125)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_reads_a_cache_through_its_strides_and_a_mask_for_all():
    # The own part of cascade attention: keys a view of a preallocated cache of 40 positions,
    # 25 filled; one mask row broadcast over the batch.
    cache_keys, cache_values = torch.randn(2, 4, 3, 40, 64).unbind(0)
    key, value = cache_keys[:, :, :25], cache_values[:, :, :25]
    query = torch.randn(4, 3, 3, 64)
    mask = torch.zeros(1, 1, 1, 25)
    mask[..., 20:] = float("-inf")
    out, lse = decode_attention(query, key, value, mask, 0.2)
    want_out, want_lse = flash(query, key.contiguous(), value.contiguous(), mask, 0.2)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_a_query_whose_keys_are_all_masked_gets_zeros_and_minus_infinity():
    query, key, value = (torch.randn(2, 1, n, 64) for n in (3, 20, 20))
    mask = torch.zeros(2, 1, 1, 20)
    mask[1] = float("-inf")
    out, lse = decode_attention(query, key, value, mask, 0.125)
    assert torch.equal(out[1], torch.zeros(1, 3, 64))
    assert torch.equal(lse[1], torch.full((1, 3), float("-inf")))
    want_out, want_lse = flash(query[:1], key[:1], value[:1], None, 0.125)
    torch.testing.assert_close(out[:1], want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse[:1], want_lse, rtol=1e-5, atol=1e-5)


def test_leaves_to_torch_what_it_does_not_take():
    query, key, value = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64)
    assert decode_attention(query, key, value, None, 1.0) is not None
    for args in [
        (query.double(), key.double(), value.double(), None),  # float64
        (query.bfloat16(), key.bfloat16(), value.bfloat16(), None),
        (torch.randn(1, 1, 2, 80), torch.randn(1, 1, 5, 80), torch.randn(1, 1, 5, 80), None),
        (torch.randn(1, 1, 65, 64), key, value, None),  # a prefill's query block
        (query, key, value, torch.zeros(1, 1, 2, 5)),  # a mask of its own a query
        (query, key, value, torch.zeros(1, 1, 1, 5, dtype=torch.bool)),
        (query, key.transpose(2, 3).contiguous().transpose(2, 3), value, None),  # dims strided
    ]:
        assert decode_attention(*args, 1.0) is None


def test_without_a_compiler_torch_keeps_the_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    decode_attention_cpu.KERNEL.library.cache_clear()
    try:
        query, key = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 5, 64)
        assert decode_attention(query, key, key, None, 1.0) is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        decode_attention_cpu.KERNEL.library.cache_clear()
