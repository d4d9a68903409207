"""Quantized weights (`quantization="int8"` and `"int4"`): the settings, the layers, the model,
the cache keys."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rstar_kernels import cpu_features
from rstar_pipelines.llm import TRANSFORMERS_REVISION, SamplingParams, load_llm, model_ids
from rstar_pipelines.llm.cpu import quantized_linear
from rstar_pipelines.llm.cpu.kernels import quantized_cpu
from rstar_pipelines.llm.cpu.quantization import quantize, resolve_quantization
from rstar_pipelines.llm.cpu.quantized_linear import (
    FLOAT32_GEMM_ROWS,
    GEMM_ROWS,
    INT4_GEMM_ROWS,
    INT4_GROUP,
    INT4_KERNEL_ROWS,
    INT8_KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    kernel_for_batch,
    matmul_dtype,
)
from rstar_pipelines.llm.embedded import TRAINING_CONFIG_FILE
from rstar_pipelines.llm.resource import LLMResource
from rstar_pipelines.pipeline.generation import StageLLM
from rstar_pipelines.pipeline.item_cache import ItemCache
from tests.fakes.llm import TRANSFORMERS

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time"]


def test_int4_by_default_only_for_the_embedded_model_and_its_checkpoints_on_a_cpu(tmp_path):
    assert resolve_quantization(None, "embedded", "cpu") == "int4"
    # A checkpoint trained from it, and one trained from that, decode as it does.
    sft, grpo, other = tmp_path / "sft", tmp_path / "grpo", tmp_path / "other"
    for directory, base in ((sft, "embedded"), (grpo, str(sft)), (other, "/models/qwen")):
        directory.mkdir()
        (directory / TRAINING_CONFIG_FILE).write_text(json.dumps({"base_model": base}))
    assert resolve_quantization(None, str(grpo), "cpu") == "int4"
    assert resolve_quantization(None, str(grpo), "cuda") == "none"
    assert resolve_quantization(None, str(other), "cpu") == "none"
    (other / TRAINING_CONFIG_FILE).write_text(json.dumps({"base_model": str(other)}))
    assert resolve_quantization(None, str(other), "cpu") == "none"  # a loop ends
    (other / TRAINING_CONFIG_FILE).write_text("not json")
    assert resolve_quantization(None, str(other), "cpu") == "none"
    assert resolve_quantization(None, "embedded", "cuda") == "none"
    assert resolve_quantization(None, "/models/qwen", "cpu") == "none"
    assert resolve_quantization("none", "embedded", "cpu") == "none"
    assert resolve_quantization("int8", "/models/qwen", "cpu") == "int8"
    assert resolve_quantization("int8", "embedded", "cpu") == "int8"
    with pytest.raises(
        ValueError, match="quantization must be one of none, int8, int4, got 'int2'"
    ):
        resolve_quantization("int2", "embedded", "cpu")
    with pytest.raises(ValueError, match="'int8' is for the CPU; embedded is on cuda"):
        resolve_quantization("int8", "embedded", "cuda")


def float32_matmul() -> bool:
    return matmul_dtype() == torch.float32


def outputs_by_kernel(
    layer, x: torch.Tensor, want: torch.Tensor, pins: tuple[int, ...] | None = None
) -> dict[int, torch.Tensor]:
    """The layer's outputs for `x` (one token a row) pinned to each of `pins` (default: its
    packed kernel, 1 row, and its matmul, `gemm_rows`), each close to `want`, float32, and the
    same for a row whatever its batch; a forward of several tokens a row takes the matmul under
    any pin."""
    pins = pins or (1, layer.gemm_rows)
    with (
        mock.patch.object(layer, "_packed", wraps=layer._packed) as packed,
        mock.patch.object(layer, "_matmul", wraps=layer._matmul) as matmul,
    ):
        by_kernel = {}
        for rows in pins:
            with kernel_for_batch(layer, rows):
                got = by_kernel[rows] = layer(x)
                assert got.shape == want.shape and got.dtype == torch.float32
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
                # Weight-only: under one kernel a row's result does not depend on its batch.
                assert torch.equal(layer(x[2:3]), got[2:3])
        packed_pins = sum(rows < layer.gemm_rows for rows in pins)
        assert (packed.call_count, matmul.call_count) == (2 * packed_pins, 2)
        # A prefill (the same rows as 5 prompts of 3 tokens) takes the matmul, pinned or not.
        prefill = x.view(5, 3, -1)
        for rows in (None, *pins):
            with kernel_for_batch(layer, rows) if rows else contextlib.nullcontext():
                assert torch.equal(layer(prefill), by_kernel[layer.gemm_rows].view(5, 3, -1))
        assert (packed.call_count, matmul.call_count) == (2 * packed_pins, 3 + len(pins))
    return by_kernel


def test_int8_linear_keeps_each_row_on_its_own_grid():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, 48)[:, None])  # rows of very different sizes
    layer = Int8Linear(linear)
    scale = layer.scale.float()[:, None]
    dequantized = layer.weight_int8.float() * scale
    assert ((dequantized - linear.weight).abs() <= scale / 2 + 1e-6).all()
    assert (layer.weight_int8.abs().amax(dim=1) >= 126).all()  # every row uses its range
    x = torch.randn(15, 1, 64)  # a decode step of 15 rows
    want = F.linear(x.bfloat16().float(), dequantized, linear.bias)
    assert want.shape == (15, 1, 48)
    assert layer.kernel is expected_int8_kernel()
    pins = tuple(sorted({1, getattr(layer, "kernel_rows", 1), layer.gemm_rows}))

    def ours(rows: int) -> bool:  # whether a call of `rows` rows (pinned or not) runs our kernel
        return layer.kernel is not None and layer.kernel_rows <= rows < layer.gemm_rows

    counting = (
        mock.patch.object(layer.kernel, "mm", wraps=layer.kernel.mm)
        if layer.kernel
        else contextlib.nullcontext(mock.Mock(call_count=0))
    )
    with counting as calls:
        by_kernel = outputs_by_kernel(layer, x, want, pins)
        # Unpinned, each call's rows choose: 15 rows the matmul, or our kernel where one runs
        # below its gemm_rows; 1 row torch's row kernel, or ours where it runs from 1 row.
        fifteen = layer.gemm_rows if layer.gemm_rows <= 15 else layer.kernel_rows
        assert torch.equal(layer(x), by_kernel[fifteen])
        assert torch.equal(layer(x[2:3]), by_kernel[1][2:3])
    # Pinned: 15 rows and one of them under each pin; unpinned: 15 rows, then one.
    assert calls.call_count == 2 * sum(map(ours, pins)) + ours(15) + ours(1)
    if layer.kernel:
        assert (layer.kernel_rows, layer.gemm_rows) == INT8_KERNEL_ROWS[layer.kernel.name]
        # Float32 sums of the exact products, scaled afterwards: no bfloat16 rounding of the sums.
        torch.testing.assert_close(by_kernel[layer.kernel_rows], want, rtol=1e-5, atol=1e-5)
    else:
        assert layer.gemm_rows == (FLOAT32_GEMM_ROWS if float32_matmul() else GEMM_ROWS)
    # The row kernel and the matmul differ by at most the rounding of the sums to bfloat16.
    torch.testing.assert_close(by_kernel[1], by_kernel[layer.gemm_rows], rtol=8e-3, atol=1e-2)


def q4_1_layer(out_features: int, in_features: int) -> torch.nn.Linear:
    """A linear layer whose weights lie on a Q4_1 grid (`scale * q + min` per group of 32, with
    each group's q spanning 0..15 as llama.cpp's quantizer makes it), scales and minimums chosen
    so that the kernel's bfloat16 scale and zero hold them exactly."""
    generator = torch.Generator().manual_seed(0)
    groups = in_features // INT4_GROUP
    q = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=generator)
    q[:, :, 0], q[:, :, 1] = 0, 15
    exponent = torch.randint(-12, -2, (out_features, groups, 1), generator=generator)
    scale = torch.exp2(exponent.float())  # a power of two: exact in bfloat16
    minimum = -scale * torch.randint(0, 16, scale.shape, generator=generator)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_((scale * q + minimum).view(out_features, in_features))
    return linear


def expected_int4_kernel() -> quantized_cpu.QuantizedKernel | None:
    """The kernel of our own an int4 layer runs here: AMX; else the AVX-512 bfloat16 dot products
    where the matmul is bfloat16, or the AVX FMAs where it is float32."""
    if quantized_cpu.AMX.available():
        return quantized_cpu.AMX
    if float32_matmul():
        return quantized_cpu.avx_kernel()
    return quantized_cpu.AVX512_BF16 if quantized_cpu.AVX512_BF16.available() else None


def expected_int8_kernel() -> quantized_cpu.QuantizedKernel | None:
    """The kernel of our own an int8 layer runs here: the bfloat16 dot products where int4 layers
    run them."""
    if expected_int4_kernel() is quantized_cpu.AVX512_BF16:
        return quantized_cpu.INT8_AVX512_BF16
    return None


def test_int4_linear_lands_on_the_q4_1_grid_it_was_given():
    linear = q4_1_layer(48, 3 * INT4_GROUP)
    layer = Int4Linear(linear)
    assert layer.kernel == expected_int4_kernel()
    packed_pins = (1, layer.kernel_rows) if layer.kernel else (1,)
    # Every kernel holds the layer's weights exactly: the matmul's as the dequantized grid, the
    # int4 kernels' as their packed integers (read back through unit inputs, with the bias).
    assert torch.equal(layer.weight_matmul.float(), linear.weight)
    for rows in packed_pins:
        with kernel_for_batch(layer, rows), torch.no_grad():
            unit = layer(torch.eye(3 * INT4_GROUP)) - linear.bias
        torch.testing.assert_close(unit, linear.weight.T, rtol=0, atol=1e-6)
    x = torch.randn(15, 1, 3 * INT4_GROUP)  # a decode step of 15 rows
    want = F.linear(x.bfloat16().float(), linear.weight, linear.bias)
    assert want.shape == (15, 1, 48)
    if layer.kernel:
        assert (layer.kernel_rows, layer.gemm_rows) == INT4_KERNEL_ROWS[layer.kernel.name]
    else:
        assert layer.gemm_rows == (FLOAT32_GEMM_ROWS if float32_matmul() else INT4_GEMM_ROWS)
    counting = (
        mock.patch.object(layer.kernel, "mm", wraps=layer.kernel.mm)
        if layer.kernel
        else contextlib.nullcontext(mock.Mock(call_count=0))
    )
    with counting as ours:
        by_kernel = outputs_by_kernel(layer, x, want, (*packed_pins, layer.gemm_rows))
        # Unpinned, each call's rows choose: 15 rows our kernel where one runs (below its
        # gemm_rows), else the kernel 15 rows choose (torch's int4 kernel, or the matmul).
        fifteen = layer.gemm_rows if layer.gemm_rows <= 15 else packed_pins[-1]
        assert torch.equal(layer(x), by_kernel[fifteen])
    torch.testing.assert_close(by_kernel[1], by_kernel[layer.gemm_rows], rtol=8e-3, atol=1e-2)
    if layer.kernel:
        # Float32 sums of the exact weights: the bfloat16 rounding of torch's kernel's sums and
        # the matmul's are not in it.
        torch.testing.assert_close(by_kernel[layer.kernel_rows], want, rtol=1e-5, atol=1e-5)
    # Pinned: 15 rows and one of them; unpinned: 15 rows.
    assert ours.call_count == (3 if layer.kernel else 0)


def without_amx(avx=None):
    """A machine without AMX whose AVX kernel, whichever its matmul, is `avx` (None: none of ours
    runs)."""
    off = mock.Mock(available=lambda: False)
    return mock.patch.multiple(
        quantized_cpu, AMX=off, AVX512_BF16=avx or off, avx_kernel=lambda: avx
    )


def test_int4_linear_keeps_torchs_kernel_where_no_kernel_of_ours_can_run():
    linear = q4_1_layer(48, 3 * INT4_GROUP)
    with without_amx():
        layer = Int4Linear(linear)
    assert layer.kernel is None and not hasattr(layer, "weight_packed")
    x = torch.randn(4, 1, 3 * INT4_GROUP)
    with kernel_for_batch(layer, 4), mock.patch.object(quantized_cpu.QuantizedKernel, "mm") as ours:
        got = layer(x)
    assert ours.call_count == 0
    want = F.linear(x.bfloat16().float(), linear.weight, linear.bias)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_each_avx_kernel_runs_where_the_matmul_it_was_measured_against_runs():
    """Without AMX, the bfloat16 dot products run where the matmul is bfloat16 (AVX512-BF16) and
    the FMAs where it is float32, each with its crossovers; where the dot products cannot be
    built, torch's kernel and the bfloat16 matmul stay. Int8 layers run the dot products where
    int4 layers do and their shape fits its blocks, else torch's row kernel."""
    linear, odd = q4_1_layer(48, 3 * INT4_GROUP), torch.nn.Linear(40, 48)
    dot, fma, dot8 = (mock.Mock(spec=quantized_cpu.QuantizedKernel) for _ in "abc")
    dot.pack = fma.pack = quantized_cpu.pack_pairs
    dot8.pack = quantized_cpu.pack_int8
    dot.name = dot8.name = "AVX512-BF16"
    fma.name = "AVX-512"
    for dtype, built, kernel, int8 in (
        (torch.bfloat16, True, dot, dot8),
        (torch.float32, True, fma, None),
        (torch.bfloat16, False, None, None),
    ):
        dot.available.return_value = dot8.available.return_value = built
        with (
            mock.patch.object(quantized_linear, "matmul_dtype", return_value=dtype),
            mock.patch.multiple(
                quantized_cpu,
                AMX=mock.Mock(available=lambda: False),
                AVX512_BF16=dot,
                INT8_AVX512_BF16=dot8,
                avx_kernel=lambda: fma,
            ),
        ):
            layer, int8_layer, odd_layer = Int4Linear(linear), Int8Linear(linear), Int8Linear(odd)
        assert layer.kernel is kernel
        rows = INT4_KERNEL_ROWS[kernel.name] if kernel else (None, INT4_GEMM_ROWS)
        assert (getattr(layer, "kernel_rows", None), layer.gemm_rows) == rows
        assert int8_layer.kernel is int8 and odd_layer.kernel is None
        if int8:
            assert (int8_layer.kernel_rows, int8_layer.gemm_rows) == INT8_KERNEL_ROWS[int8.name]


def test_the_matmul_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    matmul_dtype.cache_clear()
    try:
        for flags, dtype in (
            ({"avx2", "fma"}, torch.float32),
            ({"avx512f", "avx512_bf16"}, torch.bfloat16),
            ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
        ):
            monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: flags)
            assert matmul_dtype() == dtype
            matmul_dtype.cache_clear()
    finally:
        matmul_dtype.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_matmuls_hold_the_same_weights(dtype):
    linear = q4_1_layer(48, 3 * INT4_GROUP)
    with (
        mock.patch.object(quantized_linear, "matmul_dtype", return_value=dtype),
        without_amx(),
    ):
        int4, int8 = Int4Linear(linear), Int8Linear(linear)
    assert int4.gemm_rows == (FLOAT32_GEMM_ROWS if dtype == torch.float32 else INT4_GEMM_ROWS)
    assert int4.weight_matmul.dtype == int8.weight_matmul.dtype == dtype
    x = torch.randn(15, 1, 3 * INT4_GROUP).bfloat16().float()
    int8_weight = int8.weight_int8.float() * int8.scale.float()[:, None]
    for layer, weight in ((int4, linear.weight), (int8, int8_weight)):
        want = F.linear(x, weight, linear.bias)
        with kernel_for_batch(layer, layer.gemm_rows):
            got = layer(x)
        assert got.dtype == torch.float32
        if dtype == torch.float32:
            # Float32 products and sums of the same values (int8's scale applied after the
            # sums): only the order and roundings of the sums differ.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        # Under the matmul a row's result does not depend on its batch (float32: padded).
        with kernel_for_batch(layer, layer.gemm_rows):
            for rows in (slice(2, 3), slice(0, 5), slice(3, 14)):
                assert torch.equal(layer(x[rows]), got[rows])


def test_int4_linear_rounds_other_weights_to_their_groups_grid():
    torch.manual_seed(0)
    linear = torch.nn.Linear(2 * INT4_GROUP, 32, bias=False)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, 32)[:, None])
    layer = Int4Linear(linear)
    scale, zero = layer.scales_and_zeros.float().unbind(-1)  # [groups, out]
    step = scale.T.repeat_interleave(INT4_GROUP, dim=1)
    error = (layer.weight_matmul.float() - linear.weight).abs()
    # Half a step from its grid point, and the grid's bfloat16 rounding on top.
    assert (error <= step / 2 + linear.weight.abs() / 128).all()
    # Each group's least and greatest weights are its grid's ends (q = 0 and q = 15).
    groups = linear.weight.detach().view(32, -1, INT4_GROUP)
    low = zero.T - 8 * scale.T
    torch.testing.assert_close(low, groups.amin(-1), rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(low + 15 * scale.T, groups.amax(-1), rtol=1e-2, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 32 and outputs in 16s, not 40 -> 32"):
        Int4Linear(torch.nn.Linear(40, 32))
    assert not Int4Linear.fits(torch.nn.Linear(64, 24))


def test_int4_linear_on_a_base_models_grid_moves_only_what_training_moved():
    base = q4_1_layer(32, 2 * INT4_GROUP)
    grid = Int4Linear(base).scales_and_zeros
    step = grid[..., 0].float().T.repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    trained = q4_1_layer(32, 2 * INT4_GROUP)
    with torch.no_grad():
        trained.weight.add_(0.2 * step * torch.rand_like(step))  # less than half a step: no move
        trained.weight[3, 0] += step[3, 0]  # a group's least weight (q = 0): to q = 1
        trained.weight[4, INT4_GROUP] += 40 * step[4, INT4_GROUP]  # past the range: its end
    layer = Int4Linear(trained, grid)
    assert torch.equal(layer.scales_and_zeros, grid)
    decoded = layer.weight_matmul.float()
    moved = decoded != base.weight
    assert moved.sum() == 2 and moved[3, 0] and moved[4, INT4_GROUP]
    assert decoded[3, 0] == base.weight[3, 0] + step[3, 0]
    zero = grid[..., 1].float().T.repeat_interleave(INT4_GROUP, dim=1)
    assert decoded[4, INT4_GROUP] == zero[4, INT4_GROUP] + 7 * step[4, INT4_GROUP]  # q = 15
    with pytest.raises(ValueError, match=r"a grid of shape \(2, 32, 2\) for a layer of 64 -> 48"):
        Int4Linear(torch.nn.Linear(2 * INT4_GROUP, 48), grid)


def test_a_checkpoint_quantized_on_its_bases_grid_decodes_as_the_base_where_untrained(tiny_base):
    base = quantize(AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32), "int4")
    trained = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    with torch.no_grad():
        trained.model.layers[1].mlp.down_proj.weight.mul_(3.0)  # the one layer training moved
    quantize(trained, "int4", grid=base)
    int4 = {n: m for n, m in trained.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 14  # 2 decoder layers of q, k, v, o, gate, up, down
    for name, layer in int4.items():
        base_layer = base.get_submodule(name)
        assert torch.equal(layer.scales_and_zeros, base_layer.scales_and_zeros)
        same = torch.equal(layer.weight_matmul, base_layer.weight_matmul)
        assert same == (name != "model.layers.1.mlp.down_proj"), name


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_model_stays_close_to_float32(tiny_base, scheme):
    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator)
    with torch.inference_mode():
        reference = model(input_ids=ids).logits.log_softmax(-1)
        quantized = quantize(model, scheme)
        got = quantized(input_ids=ids).logits.log_softmax(-1)
    assert quantized is model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # The LM head is int8 in both (the embedded file keeps it in 8 bits).
    assert isinstance(model.lm_head, Int8Linear)
    layer = Int4Linear if scheme == "int4" else Int8Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, layer)
    difference = (got - reference).abs().max().item()
    assert 0 < difference < 0.05, difference  # quantized, and close (log-probabilities)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_only_float32_models_are_quantized(tiny_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"takes a float32 model, this one is torch.bfloat16"):
        quantize(model, "int8")


def test_the_backend_names_and_loads_each_scheme_apart(tiny_base):
    dense = load_llm("transformers", tiny_base, device="cpu")
    int8 = load_llm("transformers", tiny_base, device="cpu", quantization="int8")
    int4 = load_llm("transformers", tiny_base, device="cpu", quantization="int4")
    assert dense.name == f"{TRANSFORMERS}:{tiny_base}"
    assert int8.name == f"{TRANSFORMERS}:{tiny_base}+int8"
    assert int4.name == f"{TRANSFORMERS}:{tiny_base}+int4"
    assert len({id(dense._model), id(int8._model), id(int4._model)}) == 3
    assert isinstance(int8._model.model.layers[0].self_attn.q_proj, Int8Linear)
    assert isinstance(int4._model.model.layers[0].self_attn.q_proj, Int4Linear)
    assert isinstance(dense._model.lm_head, torch.nn.Linear)


def test_completions_of_another_scheme_or_of_older_code_never_come_from_the_cache(
    tiny_base, tmp_path, monkeypatch
):
    cache = ItemCache(tmp_path / "completions.sqlite", namespace="Generate@1")
    sampling = SamplingParams(temperature=0, max_tokens=6)

    def complete(quantization: str) -> str:
        resource = LLMResource(model=tiny_base, device="cpu", quantization=quantization)
        context = SimpleNamespace(resource=lambda _: resource)
        stage_llm = StageLLM(SimpleNamespace(model=None), context)
        stage_llm.complete(PROMPTS, sampling, cache)
        return stage_llm.name

    names = [complete(q) for q in ("int8", "none", "int4", "int8", "none", "int4")]
    # Each scheme computed its own completions once; the repeats found them.
    assert (cache.misses, cache.hits) == (3 * len(PROMPTS), 3 * len(PROMPTS))
    assert names[:3] == [
        f"{TRANSFORMERS}:{tiny_base}+int8",
        f"{TRANSFORMERS}:{tiny_base}",
        f"{TRANSFORMERS}:{tiny_base}+int4",
    ]
    # A change to what the backend computes bumps its revision: what older code cached is not
    # served, whatever the scheme.
    monkeypatch.setattr(model_ids, "TRANSFORMERS_REVISION", TRANSFORMERS_REVISION + 1)
    bumped = f"transformers@{TRANSFORMERS_REVISION + 1}:{tiny_base}"
    assert [complete("int4"), complete("none")] == [bumped + "+int4", bumped]
    assert (cache.misses, cache.hits) == (5 * len(PROMPTS), 3 * len(PROMPTS))


def test_the_resource_defaults_environment_and_refusals(monkeypatch):
    monkeypatch.delenv("RSTAR_LLM_QUANTIZATION", raising=False)
    monkeypatch.delenv("RSTAR_LLM_BACKEND", raising=False)
    assert LLMResource(device="cpu").model_id() == f"{TRANSFORMERS}:embedded+int4"
    assert LLMResource(device="cpu", quantization="none").model_id() == f"{TRANSFORMERS}:embedded"
    monkeypatch.setenv("RSTAR_LLM_QUANTIZATION", "none")
    assert LLMResource(device="cpu").model_id() == f"{TRANSFORMERS}:embedded"
    int8 = LLMResource(device="cpu", quantization="int8")
    assert int8.model_id() == f"{TRANSFORMERS}:embedded+int8"
    monkeypatch.delenv("RSTAR_LLM_QUANTIZATION")
    server = {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    assert LLMResource(**server).model_id() == "openai:m"
    with pytest.raises(ValueError, match="quantization='int8' is a setting of the transformers"):
        LLMResource(**server, quantization="int8").get_llm()
