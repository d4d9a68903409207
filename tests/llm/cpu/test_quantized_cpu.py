"""The kernels of `llm.cpu.kernels.quantized_cpu` (int4: AMX, AVX-512 bfloat16 dot products, AVX-512
and AVX2 FMAs; int8: the dot products): their layouts, their sums, their rows' independence, and
how they stay off where they cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from rstar_pipelines.llm.cpu.kernels import c_library, quantized_cpu

ALL_KERNELS = (
    quantized_cpu.AMX,
    quantized_cpu.AVX512_BF16,
    quantized_cpu.AVX512,
    quantized_cpu.AVX2,
    quantized_cpu.INT8_AVX512_BF16,
)
KERNELS = [
    pytest.param(
        kernel,
        id=kernel.label,
        # Only the CPU's flags decide: a kernel the CPU can run that does not build fails.
        marks=pytest.mark.skipif(
            not kernel.runs_here(), reason=f"the CPU cannot run the {kernel.label} kernel"
        ),
    )
    for kernel in ALL_KERNELS
]


def random_layer(
    kernel: quantized_cpu.QuantizedKernel, out_features: int, in_features: int, seed: int = 0
):
    """Integers, scales and zeros (int8: scales) of a random layer in `kernel`'s layout, and its
    float64 weights."""
    generator = torch.Generator().manual_seed(seed)
    if kernel.weights == "int8":
        q = torch.randint(-127, 128, (out_features, in_features), generator=generator)
        scale = (torch.rand(out_features, generator=generator) * 0.02 + 1e-3).bfloat16().float()
        return (kernel.pack(q), scale), q * scale.double()[:, None]
    groups = in_features // quantized_cpu.GROUP
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scale = (torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3).bfloat16()
    zero = (torch.randn(out_features, groups, generator=generator) * 0.01).bfloat16()
    weight = (q.view(out_features, groups, -1) - 8) * scale.double()[..., None]
    weight = (weight + zero.double()[..., None]).view(out_features, in_features)
    packed = kernel.pack(q), quantized_cpu.pack_groups(scale), quantized_cpu.pack_groups(zero)
    return packed, weight


def test_the_amx_layout_puts_each_weight_in_its_tile_lane():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(1))
    packed = quantized_cpu.pack_amx(q)
    assert packed.shape == (2, 2, 8, 32) and packed.dtype == torch.uint8
    # Lane i of tile row j of (block, group) is q[16 block + i // 2, 32 group + 2 j + i % 2];
    # rows 2p and 2p + 1 share byte i of pair p, low and high nibble.
    for block, group, row, lane in ((0, 0, 0, 0), (1, 1, 15, 31), (0, 1, 6, 5), (1, 0, 9, 18)):
        byte = int(packed[block, group, row // 2, lane])
        nibble = byte >> 4 if row % 2 else byte & 0xF
        assert nibble == q[16 * block + lane // 2, 32 * group + 2 * row + lane % 2]
    scale = torch.arange(32 * 2, dtype=torch.float32).view(32, 2)
    assert torch.equal(quantized_cpu.pack_groups(scale)[1, 0], scale[16:, 0])


def test_the_pair_layout_puts_each_input_pair_of_an_output_in_one_byte():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(1))
    packed = quantized_cpu.pack_pairs(q)
    assert packed.shape == (2, 2, 16, 16) and packed.dtype == torch.uint8
    for block, group, pair, output in ((0, 0, 0, 0), (1, 1, 15, 15), (0, 1, 6, 5), (1, 0, 9, 12)):
        byte = int(packed[block, group, pair, output])
        assert byte & 0xF == q[16 * block + output, 32 * group + 2 * pair]
        assert byte >> 4 == q[16 * block + output, 32 * group + 2 * pair + 1]


def test_the_int8_layout_puts_each_input_pair_of_16_outputs_in_two_rows_of_bytes():
    q = torch.randint(-127, 128, (32, 64), generator=torch.Generator().manual_seed(1))
    packed = quantized_cpu.pack_int8(q)
    assert packed.shape == (2, 2, 16, 2, 16) and packed.dtype == torch.int8
    for block, group, pair, parity, output in ((0, 0, 0, 0, 0), (1, 1, 15, 1, 15), (0, 1, 6, 1, 5)):
        want = q[16 * block + output, 32 * group + 2 * pair + parity]
        assert int(packed[block, group, pair, parity, output]) == want


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 17, 31, 40])
@pytest.mark.parametrize("shape", [(576, 1536), (192, 576), (48, 96)])
def test_the_kernel_sums_the_exact_weights_in_float32(kernel, rows, shape):
    packed, weight = random_layer(kernel, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    got = kernel.mm(x.to(kernel.activations), *packed)
    want = x.double() @ weight.T
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())
    # A row's result is the same bits alone, whatever the rows beside it or its tile.
    for row in {0, rows // 2, rows - 1}:
        alone = x[row : row + 1].to(kernel.activations)
        assert torch.equal(kernel.mm(alone, *packed)[0], got[row])


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_names_what_it_takes(kernel):
    packed, _ = random_layer(kernel, 48, 96)
    other = torch.float32 if kernel.activations == torch.bfloat16 else torch.bfloat16
    with pytest.raises(
        ValueError, match=rf"contiguous {kernel.activations} \[rows, 96\], not {other}"
    ):
        kernel.mm(torch.randn(2, 96, dtype=other), *packed)
    with pytest.raises(ValueError, match=rf"not {kernel.activations} \(2, 64\)"):
        kernel.mm(torch.randn(2, 64, dtype=kernel.activations), *packed)
    with pytest.raises(ValueError, match=f"not {kernel.activations}"):
        kernel.mm(torch.randn(96, 2, dtype=kernel.activations).T, *packed)
    # int4 weights need their zeros; int8 weights have none.
    x = torch.randn(2, 96, dtype=kernel.activations)
    wrong = packed[:2] if len(packed) == 3 else (*packed, packed[1])
    with pytest.raises(ValueError, match="int4 weights take a zero, int8 weights none"):
        kernel.mm(x, *wrong)


def test_each_kernel_needs_the_cpu_features_linux_names_for_its_flags():
    assert [kernel.needs for kernel in ALL_KERNELS] == [
        {"avx512f", "avx512bw", "amx_tile", "amx_bf16"},
        {"avx512f", "avx512_bf16", "fma"},
        {"avx512f", "fma"},
        {"avx2", "fma"},
        {"avx512f", "avx512_bf16", "fma"},
    ]


@pytest.mark.parametrize("kernel", ALL_KERNELS, ids=repr)
def test_without_a_compiler_the_kernel_stays_off_and_says_why(
    kernel, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(c_library, "cpu_flags", lambda: set(kernel.needs))
    monkeypatch.setattr(c_library, "_warned", set())
    kernel.library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=c_library.__name__):
            monkeypatch.setenv("CC", "false")  # a compiler that always fails
            assert not kernel.available()
            assert f"{kernel.label} kernel off, torch's runs: " in caplog.text
            assert "false failed to build it" in caplog.text
            kernel.library.cache_clear()
            monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
            assert not kernel.available()
            assert "no C compiler" in caplog.text
            kernel.library.cache_clear()
            monkeypatch.setattr(c_library, "cpu_flags", lambda: {"sse2"})
            assert not kernel.available()
            lacks = ", ".join(sorted(kernel.needs))
            assert f"{kernel.label} kernel off: the CPU lacks {lacks}" in caplog.text
        with pytest.raises(RuntimeError, match=f"{kernel.label} kernel is not available"):
            kernel.mm(
                torch.zeros(1, 32, dtype=kernel.activations), *random_layer(kernel, 16, 32)[0]
            )
        assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
    finally:
        kernel.library.cache_clear()


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_library_is_built_once_into_the_cache(kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.library.cache_clear()
    try:
        assert kernel.available()
        (built,) = tmp_path.rglob(f"{kernel.source.stem}-*.so")
        stamp = built.stat().st_mtime_ns
        kernel.library.cache_clear()
        assert kernel.available() and built.stat().st_mtime_ns == stamp
    finally:
        kernel.library.cache_clear()
