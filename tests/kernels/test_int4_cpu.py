"""The int4 AMX kernel (`rstar_kernels.int4_cpu`): its layout, its sums, its rows' independence,
and how it stays off where it cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from rstar_kernels import int4_cpu

needs_amx = pytest.mark.skipif(not int4_cpu.available(), reason="the CPU has no AMX")


def random_layer(out_features: int, in_features: int, seed: int = 0):
    """Integers, scales and zeros of a random int4 layer, and its float64 weights."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // int4_cpu.GROUP
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scale = (torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3).bfloat16()
    zero = (torch.randn(out_features, groups, generator=generator) * 0.01).bfloat16()
    weight = (q.view(out_features, groups, -1) - 8) * scale.double()[..., None]
    weight = (weight + zero.double()[..., None]).view(out_features, in_features)
    packed = int4_cpu.pack(q), int4_cpu.pack_groups(scale), int4_cpu.pack_groups(zero)
    return packed, weight


def test_the_layout_puts_each_weight_in_its_tile_lane():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(1))
    packed = int4_cpu.pack(q)
    assert packed.shape == (2, 2, 8, 32) and packed.dtype == torch.uint8
    # Lane i of tile row j of (block, group) is q[16 block + i // 2, 32 group + 2 j + i % 2];
    # rows 2p and 2p + 1 share byte i of pair p, low and high nibble.
    for block, group, row, lane in ((0, 0, 0, 0), (1, 1, 15, 31), (0, 1, 6, 5), (1, 0, 9, 18)):
        byte = int(packed[block, group, row // 2, lane])
        nibble = byte >> 4 if row % 2 else byte & 0xF
        assert nibble == q[16 * block + lane // 2, 32 * group + 2 * row + lane % 2]
    scale = torch.arange(32 * 2, dtype=torch.float32).view(32, 2)
    assert torch.equal(int4_cpu.pack_groups(scale)[1, 0], scale[16:, 0])


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 31, 40])
@pytest.mark.parametrize("shape", [(576, 1536), (192, 576), (48, 96)])
def test_the_kernel_sums_the_exact_weights_in_float32(rows, shape):
    packed, weight = random_layer(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    got = int4_cpu.mm(x, *packed)
    want = x.double() @ weight.T
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())
    # A row's result is the same bits alone, whatever the rows beside it or its tile.
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(int4_cpu.mm(x[row : row + 1].contiguous(), *packed)[0], got[row])


@needs_amx
def test_the_kernel_names_what_it_takes():
    packed, _ = random_layer(48, 96)
    with pytest.raises(ValueError, match=r"contiguous bfloat16 \[rows, 96\], not torch.float32"):
        int4_cpu.mm(torch.randn(2, 96), *packed)
    with pytest.raises(ValueError, match=r"not torch.bfloat16 \(2, 64\)"):
        int4_cpu.mm(torch.randn(2, 64).bfloat16(), *packed)
    with pytest.raises(ValueError, match="not torch.bfloat16"):
        int4_cpu.mm(torch.randn(96, 2).bfloat16().T, *packed)


def test_without_a_compiler_the_kernel_stays_off_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(int4_cpu, "cpu_flags", lambda: set(int4_cpu.CPU_FLAGS))
    int4_cpu._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=int4_cpu.__name__):
            monkeypatch.setenv("CC", "false")  # a compiler that always fails
            assert not int4_cpu.available()
            assert "false failed to build it" in caplog.text
            int4_cpu._library.cache_clear()
            monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
            assert not int4_cpu.available()
            assert "no C compiler" in caplog.text
            int4_cpu._library.cache_clear()
            monkeypatch.setattr(int4_cpu, "cpu_flags", lambda: {"avx512f"})
            assert not int4_cpu.available()
            assert "the CPU lacks amx_bf16, amx_tile, avx512bw" in caplog.text
        with pytest.raises(RuntimeError, match="not available on this machine"):
            int4_cpu.mm(torch.zeros(1, 32, dtype=torch.bfloat16), *random_layer(16, 32)[0])
        assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
    finally:
        int4_cpu._library.cache_clear()


@needs_amx
def test_the_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    int4_cpu._library.cache_clear()
    try:
        assert int4_cpu.available()
        (built,) = tmp_path.rglob("int4_cpu-*.so")
        stamp = built.stat().st_mtime_ns
        int4_cpu._library.cache_clear()
        assert int4_cpu.available() and built.stat().st_mtime_ns == stamp
    finally:
        int4_cpu._library.cache_clear()
