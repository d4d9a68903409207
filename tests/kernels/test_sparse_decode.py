"""Block-sparse decode attention: the PyTorch reference against a brute-force gather, the Triton
kernel (the interpreter on a CPU) and the TileLang kernel (lowered to CUDA source on a CPU, run on
a GPU) against the reference.

The Triton interpreter must be switched on before triton is first imported.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rstar_kernels
from rstar_kernels import dense_decode_reference, sparse_decode, sparse_decode_reference
from rstar_kernels.decode_triton import num_splits_heuristic, sparse_decode_triton

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# (atol, rtol). fp16/bf16: the kernels round probabilities to the input dtype before P·V and both
# sides round the output once.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def make_case(
    *, batch=3, h_kv=2, group=4, head_dim=64, length=320, block_size=64, budget=3,
    dtype=torch.float32, left_pad=True, seed=0, device=DEVICE,
):  # fmt: skip
    """Random q/k/v, ragged seqlens, left padding, and per (row, KV head) `budget` distinct blocks
    drawn from the row's valid blocks, shuffled among -1 pads (so unsorted, pads anywhere)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, h_kv * group, head_dim, generator=gen)
    k = torch.randn(batch, h_kv, length, head_dim, generator=gen)
    v = torch.randn(batch, h_kv, length, head_dim, generator=gen)
    seqlens = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    seqlens[0] = length
    starts = torch.zeros(batch, dtype=torch.long)
    if left_pad:
        starts = torch.randint(0, length // 3, (batch,), generator=gen)
        starts[-1] = 0
    width = budget + 2
    indices = torch.full((batch, h_kv, width), -1, dtype=torch.int32)
    for b in range(batch):
        first, last = int(starts[b]) // block_size, -(-int(seqlens[b]) // block_size)
        for h in range(h_kv):
            blocks = first + torch.randperm(last - first, generator=gen)[:budget]
            slots = torch.randperm(width, generator=gen)[: len(blocks)]
            indices[b, h, slots] = blocks.int()
    tensors = (q, k, v, indices, seqlens.int(), starts.int())
    q, k, v, indices, seqlens, starts = (t.to(device) for t in tensors)
    return q.to(dtype), k.to(dtype), v.to(dtype), indices, seqlens, starts


def brute_force(q, k, v, indices, seqlens, starts, block_size, scale):
    """Per (row, query head): list the visible tokens, gather them, softmax in float64."""
    batch, h_q, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    out = torch.zeros(batch, h_q, d, dtype=torch.float64)
    for b in range(batch):
        lo, hi = int(starts[b]), min(int(seqlens[b]), length)
        for h in range(h_q):
            kv = h // (h_q // h_kv)
            tokens = sorted(
                t
                for j in indices[b, kv].tolist()
                if j >= 0
                for t in range(j * block_size, (j + 1) * block_size)
                if lo <= t < hi
            )
            if tokens:
                keys, values = k[b, kv, tokens].double(), v[b, kv, tokens].double()
                probs = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
                out[b, h] = probs @ values
    return out


def assert_matches(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_brute_force(group, seed):
    budget = [1, 3, 5][seed]
    q, k, v, idx, seqlens, starts = make_case(group=group, budget=budget, seed=seed, device="cpu")
    # One KV head of one row selects nothing, another selects a block wholly in the left padding.
    idx[1, 0] = -1
    starts[2], idx[2, 1, 0] = 70, 0
    scale = 0.3 if seed == 2 else 1 / math.sqrt(q.shape[-1])
    expected = brute_force(q, k, v, idx, seqlens, starts, 64, scale)
    actual = sparse_decode_reference(q, k, v, idx, seqlens, 64, starts=starts, scale=scale)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_matches_reference(dtype, group, head_dim):
    seed = group * 10 + head_dim
    q, k, v, idx, seqlens, starts = make_case(
        group=group, head_dim=head_dim, length=300, budget=3, dtype=dtype, seed=seed
    )
    expected = sparse_decode_reference(q, k, v, idx, seqlens, 64, starts=starts)
    actual = sparse_decode(q, k, v, idx, seqlens, 64, backend="triton", starts=starts)
    assert actual.dtype == dtype and actual.shape == q.shape
    assert_matches(actual, expected, dtype)


@pytest.mark.parametrize("budget", [1, 2, 5, 8])
@pytest.mark.parametrize("num_split", [1, 3])
def test_triton_budgets_and_splits(budget, num_split):
    # 512 tokens = 8 blocks: budget 8 selects every block of the longest row.
    q, k, v, idx, seqlens, starts = make_case(
        batch=2, length=512, budget=budget, dtype=torch.float16, seed=budget
    )
    expected = sparse_decode_reference(q, k, v, idx, seqlens, 64, starts=starts)
    actual = sparse_decode_triton(q, k, v, idx, seqlens, 64, starts=starts, num_split=num_split)
    assert_matches(actual, expected, torch.float16)


@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_other_block_sizes(block_size):
    q, k, v, idx, seqlens, starts = make_case(
        batch=2, length=200, block_size=block_size, budget=4, seed=block_size
    )
    expected = brute_force(q, k, v, idx, seqlens, starts, block_size, 1 / math.sqrt(64))
    actual = sparse_decode(q, k, v, idx, seqlens, block_size, backend="triton", starts=starts)
    assert_matches(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_without_visible_tokens_are_zero(backend):
    q, k, v, idx, seqlens, starts = make_case(batch=3, budget=2, seed=5)
    idx[0, 1] = -1  # nothing selected
    starts[1] = seqlens[1]  # an empty row
    idx[2, 0] = torch.tensor([-1, 4, -1, -1], dtype=torch.int32)  # a block past seqlens[2]
    seqlens[2] = 200
    out = sparse_decode(q, k, v, idx, seqlens, 64, backend=backend, starts=starts).cpu()
    g = q.shape[1] // k.shape[1]
    assert torch.equal(out[0, g:], torch.zeros_like(out[0, g:]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[2, :g], torch.zeros_like(out[2, :g]))
    assert out[0, :g].abs().sum() > 0 and out[2, g:].abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stale_cache_values_do_not_leak(backend):
    q, k, v, idx, seqlens, starts = make_case(batch=2, budget=5, dtype=torch.float16, seed=7)
    expected = sparse_decode(q, k, v, idx, seqlens, 64, backend=backend, starts=starts)
    pos = torch.arange(k.shape[2], device=k.device)
    hidden = (pos < starts[:, None]) | (pos >= seqlens[:, None])
    k[hidden[:, None, :].expand_as(k[..., 0])] = float("nan")
    v[hidden[:, None, :].expand_as(v[..., 0])] = float("nan")
    actual = sparse_decode(q, k, v, idx, seqlens, 64, backend=backend, starts=starts)
    assert hidden.any()
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_blocks_equal_dense(backend):
    q, k, v, _, seqlens, starts = make_case(batch=3, length=320, seed=3)
    # Every block, in a shuffled order per (row, KV head).
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(5, generator=gen) for _ in range(3 * 2)]).view(3, 2, 5)
    idx = idx.int().to(q.device)
    expected = dense_decode_reference(q, k, v, seqlens, starts=starts, scale=0.2)
    actual = sparse_decode(q, k, v, idx, seqlens, 64, backend=backend, starts=starts, scale=0.2)
    assert_matches(actual, expected, torch.float32)


def test_dense_reference_matches_sdpa():
    q, k, v, _, seqlens, starts = make_case(batch=2, group=4, seed=4, device="cpu")
    pos = torch.arange(k.shape[2])
    visible = (pos >= starts[:, None]) & (pos < seqlens[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None].double(),
        k.double().repeat_interleave(4, dim=1),
        v.double().repeat_interleave(4, dim=1),
        attn_mask=visible[:, None, None, :],
    )[:, :, 0]
    actual = dense_decode_reference(q, k, v, seqlens, starts=starts)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


def _bad_inputs():
    q, k, v, idx, seqlens, starts = make_case(batch=2, device="cpu")
    names = ("q", "k_cache", "v_cache", "block_indices", "seqlens", "starts")
    ok = dict(zip(names, (q, k, v, idx, seqlens, starts), strict=True))
    return [
        ({"q": q[0]}, ValueError, r"q must be \[B, H_q, D\], got shape \(8, 64\)"),
        ({"v_cache": v[:, :, :100]}, ValueError, r"v_cache shape .* != k_cache shape"),
        ({"q": q[:, :5]}, ValueError, r"H_q = 5 .* not a multiple of H_kv = 2"),
        ({"q": q[..., :32]}, ValueError, r"does not match q"),
        ({"q": q.half()}, TypeError, r"share a dtype"),
        ({"block_indices": idx.long()}, TypeError, r"block_indices must be int32"),
        ({"block_indices": idx[:, :1]}, ValueError, r"block_indices must be \[B, H_kv, S\]"),
        ({"seqlens": seqlens[:1]}, ValueError, r"seqlens must be \[B\] = \[2\]"),
        ({"starts": starts.long()}, TypeError, r"starts must be int32"),
        ({"block_size": 0}, ValueError, r"block_size must be a positive int"),
        ({"k_cache": k.to("meta"), "v_cache": v.to("meta")}, ValueError, r"k_cache is on meta"),
        ({"backend": "cuda"}, ValueError, r"backend must be one of"),
        ({"backend": "tilelang"}, ValueError, r"tilelang.* needs CUDA tensors"),
    ], ok


@pytest.mark.parametrize("case", range(13))
def test_bad_input_is_named(case):
    cases, ok = _bad_inputs()
    change, error, message = cases[case]
    args = {"backend": "torch", **ok, **change}
    with pytest.raises(error, match=message):
        sparse_decode(**args)


def test_num_splits_heuristic():
    # Tiles fill 80% of the SMs: no split.
    assert num_splits_heuristic(tiles=128, num_sms=132, num_blocks=64) == 1
    # One tile on 4 SMs: 4 splits make one full wave (efficiency 1).
    assert num_splits_heuristic(tiles=1, num_sms=4, num_blocks=8) == 4
    # 3 tiles on 4 SMs: 1, 2 and 3 splits all run at 75%, 4 splits at 100%.
    assert num_splits_heuristic(tiles=3, num_sms=4, num_blocks=8) == 4
    # Never more splits than selected blocks.
    assert num_splits_heuristic(tiles=1, num_sms=132, num_blocks=3) == 3


def test_import_is_light_and_stands_alone():
    """Importing every module loads neither the kernel compilers nor the framework above."""
    modules = ", ".join(
        f"rstar_kernels.{p.stem}"
        for p in sorted(Path(rstar_kernels.__file__).parent.glob("*.py"))
        if p.stem not in ("__init__", "vllm_backend")  # vllm_backend is vLLM's side
    )
    code = (
        f"import sys, {modules}; "
        "print(sorted({'triton', 'tilelang', 'dagster', 'rstar_pipelines'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(rstar_kernels.__file__).parents[1])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]"


def test_tilelang_lowers_to_cuda_source():
    pytest.importorskip("tilelang")
    from rstar_kernels.decode_tilelang import lower_sparse_decode

    source = lower_sparse_decode(
        batch=2, heads=32, kv_heads=8, head_dim=128, max_selected_blocks=16, block_size=64,
        target="cuda -arch=sm_90", num_split=2,
    )  # fmt: skip
    assert "__global__ void __launch_bounds__" in source
    # The split kernel and the combine kernel; Hopper gemms lower to wgmma.
    assert "sparse_decode_kernel(" in source and "sparse_decode_kernel_1(" in source
    assert "wgmma" in source


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
def test_gpu_backends_match_reference(backend, dtype, group):
    q, k, v, idx, seqlens, starts = make_case(
        batch=3, group=group, head_dim=128, length=1000, budget=6, dtype=dtype, seed=group
    )
    expected = sparse_decode_reference(q, k, v, idx, seqlens, 64, starts=starts)
    actual = sparse_decode(q, k, v, idx, seqlens, 64, backend=backend, starts=starts)
    assert_matches(actual, expected, dtype)
