"""Each private torch or transformers API the CPU speed-ups use, made to fail: its probe says so
once, with one warning, and the public fallback gives the same results."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu import capabilities, cascade_attention, quantized_linear
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.llm.transformers_backend import TransformersLLM

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(autouse=True)
def fresh_probes():
    """Every probe runs again in the test, and after it (with the APIs restored)."""
    capabilities.forget()
    yield
    capabilities.forget()


def _broken(*args, **kwargs):
    raise RuntimeError("not in this build")


def _probe_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == capabilities.__name__]


def _linear(rows: int = 64, columns: int = 96) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(columns, rows, bias=True)


@pytest.mark.parametrize("layer_class", ["int8", "int4"])
def test_quantized_layers_run_the_matmul_without_torchs_packed_kernels(
    monkeypatch, caplog, layer_class
):
    # Our C kernels stay out: the layer's own torch path is under test.
    monkeypatch.setattr(quantized_linear, "int8_kernel", lambda: None)
    monkeypatch.setattr(quantized_linear, "int4_kernel", lambda: None)
    make = quantized_linear.Int8Linear if layer_class == "int8" else quantized_linear.Int4Linear
    linear = _linear()
    x = torch.randn(1, 1, 96)
    with_kernels = make(linear)(x)
    assert with_kernels.shape == (1, 1, 64)
    ops = (
        ["_weight_int8pack_mm"]
        if layer_class == "int8"
        else ["_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"]
    )
    for op in ops:
        monkeypatch.setattr(torch.ops.aten, op, _broken, raising=False)
    capabilities.forget()
    with caplog.at_level(logging.WARNING):
        layer = make(linear)
        fallback = layer(x)
        layer(x)
    probe = (
        capabilities.int8_packed_matmul
        if layer_class == "int8"
        else capabilities.int4_packed_matmul
    )
    assert not probe()
    assert len(_probe_warnings(caplog)) == 1
    # The same weights through another kernel: equal up to bfloat16 activations' rounding.
    torch.testing.assert_close(fallback, with_kernels, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fallback, linear(x), rtol=0.1, atol=0.1)


def test_cascade_attention_computes_the_log_sum_exp_without_the_flash_kernel(monkeypatch, caplog):
    monkeypatch.setattr(cascade_attention, "decode_attention", lambda *args: None)
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    # Additive, as cascade attention hands it: the second row sees its first 5 keys.
    mask = torch.zeros(2, 1, 4, 9)
    mask[1, :, :, 5:] = float("-inf")
    expected = cascade_attention._flash(query, key, value, mask, 0.25)
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", _broken, raising=False
    )
    capabilities.forget()
    with caplog.at_level(logging.WARNING):
        found = cascade_attention._flash(query, key, value, mask, 0.25)
        cascade_attention._flash(query, key, value, mask, 0.25)
    assert not capabilities.flash_attention_lse()
    assert len(_probe_warnings(caplog)) == 1
    torch.testing.assert_close(found[0], expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found[1], expected[1], rtol=1e-4, atol=1e-5)


def test_a_query_that_sees_no_key_gets_zeros_from_the_fallback():
    query = torch.randn(1, 1, 2, 8)
    mask = torch.full((1, 1, 2, 2), float("-inf"))
    out, lse = cascade_attention.attention_with_lse(query, query, query, mask, 1.0)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all() and (lse < 0).all()


def test_models_keep_sdpa_without_transformers_attention_registries(monkeypatch, caplog, tiny_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_base, attn_implementation="sdpa")
    monkeypatch.delattr(transformers.masking_utils, "sdpa_mask")
    with caplog.at_level(logging.WARNING):
        assert not cascade_attention.use_cascade_attention(model)
        assert not cascade_attention.use_cascade_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert len(_probe_warnings(caplog)) == 1
    monkeypatch.undo()
    capabilities.forget()
    assert cascade_attention.use_cascade_attention(model)


@pytest.mark.parametrize("missing", ["DynamicLayer", "generation internals"])
def test_generation_goes_through_generate_without_the_decode_loops_internals(
    monkeypatch, caplog, tiny_base, missing
):
    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    fast = CpuTransformersLLM.wrap(model, tokenizer, name="fast")
    plain = TransformersLLM.wrap(model, tokenizer, name="plain")
    assert fast._new_cache(8) is not None

    # transformers' own generate() needs these very names, so the probes' checks fail instead.
    def check():
        raise AttributeError(f"transformers has no {missing}")

    probe_check = "_check_cache_layers" if missing == "DynamicLayer" else "_check_generation"
    monkeypatch.setattr(capabilities, probe_check, check)
    capabilities.forget()
    decoded = []
    monkeypatch.setattr("rstar_pipelines.llm.cpu.backend.decode", lambda *a, **k: decoded.append(1))
    with caplog.at_level(logging.WARNING):
        assert fast._new_cache(8) is None
        assert fast.generate(PROMPTS, GREEDY) == plain.generate(PROMPTS, GREEDY)
    assert decoded == []
    assert len(_probe_warnings(caplog)) == 1


def test_every_probe_passes_on_the_supported_releases():
    assert all(probe() for probe in capabilities.PROBES)
