"""The fused attention + block-max kernel against materialised softmax and SDPA.

Without a GPU the kernel runs under the Triton interpreter, which must be switched on before
triton is first imported.
"""

from __future__ import annotations

import pytest
import torch

from rstar_kernels.distill import distillation_target
from rstar_kernels.pooling_triton import (
    attention_with_block_max,
    attention_with_block_max_reference,
    group_max_target,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
# (out atol, block_max atol); rtol equals atol. fp16: the kernel rounds probabilities to fp16
# before the P·V product, the reference keeps them in fp32.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-4), torch.bfloat16: (2e-2, 1e-4)}


def _qkv(g, d, t, dtype, batch=2, h_kv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, h_kv * g, t, d), (batch, h_kv, t, d), (batch, h_kv, t, d)]
    return [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]


def _sdpa(q, k, v, scale=None):
    g = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(g, dim=1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k, v, is_causal=True, scale=scale
    )


def _future_blocks(t, n, block):
    own = torch.arange(t, device=DEVICE) // block
    return torch.arange(n, device=DEVICE)[None, :] > own[:, None]


def _check(q, k, v, scale=None):
    atol_out, atol_map = TOLERANCE[q.dtype]
    out, block_max = attention_with_block_max(q, k, v, BLOCK, scale=scale)
    ref_out, ref_map = attention_with_block_max_reference(q, k, v, BLOCK, scale=scale)
    t = q.shape[2]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert block_max.dtype == torch.float32
    assert block_max.shape == (*q.shape[:3], -(-t // BLOCK))
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol_out, rtol=atol_out)
    torch.testing.assert_close(out.float(), _sdpa(q, k, v, scale), atol=atol_out, rtol=atol_out)
    torch.testing.assert_close(block_max, ref_map, atol=atol_map, rtol=atol_map)
    assert (block_max[..., _future_blocks(t, block_max.shape[-1], BLOCK)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t", [48, 45], ids=["T48", "T45"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("g", [1, 4], ids=["g1", "g4"])
def test_kernel_matches_reference_and_sdpa(g, d, t, dtype):
    _check(*_qkv(g, d, t, dtype))


def test_bf16_strided_inputs_and_explicit_scale():
    # [B, T, H, D] storage seen as [B, H, T, D]: the kernel must follow the strides. On the CPU
    # bf16 goes through the interpreter's fp32 path.
    qkv = _qkv(2, 64, 37, torch.bfloat16)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv)
    assert not q.is_contiguous()
    _check(q, k, v, scale=0.2)


def test_short_sequences():
    for t in (1, BLOCK, BLOCK + 1):
        _check(*_qkv(2, 64, t, torch.float32, batch=1, h_kv=1))


def _group_target_by_loops(block_max, h_kv, block):
    b, h_q, t, n = block_max.shape
    g = h_q // h_kv
    target = torch.zeros(b, h_kv, t, n)
    for bi, hk, row in ((bi, hk, row) for bi in range(b) for hk in range(h_kv) for row in range(t)):
        own = row // block
        vals = [max(block_max[bi, hk * g + j, row, c].item() for j in range(g)) for c in range(own)]
        total = sum(vals) + 1e-9
        for c, val in enumerate(vals):
            target[bi, hk, row, c] = val / total
    return target


def test_group_max_target_by_loops():
    block = 4
    gen = torch.Generator().manual_seed(1)
    block_max = torch.rand(2, 6, 11, 3, generator=gen)
    target, row_mask = group_max_target(block_max, 2, block)
    torch.testing.assert_close(target, _group_target_by_loops(block_max, 2, block))
    expected_rows = (torch.arange(11) >= block).expand(2, 11)
    assert torch.equal(row_mask, expected_rows)
    torch.testing.assert_close(target.sum(-1)[:, :, row_mask[0]], torch.ones(2, 2, 7))


@pytest.mark.parametrize("t", [48, 45], ids=["T48", "T45"])
def test_fused_target_matches_distillation_target(t):
    q, k, v = _qkv(4, 64, t, torch.float32)
    _, block_max = attention_with_block_max(q, k, v, BLOCK)
    target, row_mask = group_max_target(block_max, k.shape[1], BLOCK)
    expected, expected_rows = distillation_target(q, k, k.shape[1], BLOCK)
    torch.testing.assert_close(target, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(row_mask, expected_rows)


def test_bad_inputs_are_named():
    q, k, v = _qkv(2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        attention_with_block_max(q, k, v, block_size=24)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention_with_block_max(q[:, :3], k, v, BLOCK)
    with pytest.raises(ValueError, match="dtypes differ"):
        attention_with_block_max(q, k.half(), v, BLOCK)
    with pytest.raises(ValueError, match="must match q"):
        attention_with_block_max(q, k[:, :, :16], v[:, :, :16], BLOCK)
    with pytest.raises(ValueError, match="expected ceil"):
        group_max_target(torch.zeros(1, 4, 32, 3), 2, BLOCK)
