"""The SeerAttention-R gate against hand computations: parameter counts (docs/seer-attention.md),
family detection, pre-RoPE capture, RoPE at block starts, block pooling, save and load."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rstar_kernels.gate import (
    AttnGate,
    GateConfig,
    SeerGates,
    capture_pre_rope,
    gate_parameter_count,
    model_family,
)

TINY = {
    "vocab_size": 50,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_model(family: str):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**TINY)).eval()


def tiny_gate(qk_norm: bool = True, **overrides) -> AttnGate:
    torch.manual_seed(1)
    config = GateConfig.for_model(LlamaConfig(**TINY), block_size=4, gate_dim=6, qk_norm=qk_norm)
    gate = AttnGate(config)
    if qk_norm:  # non-trivial norm weights, so the test sees them applied
        with torch.no_grad():
            gate.q_norm.weight.uniform_(0.5, 1.5)
            gate.k_norm.weight.uniform_(0.5, 1.5)
    return gate


# -- sizes --


@pytest.mark.parametrize(
    ("layers", "heads", "total_m", "megabytes"),
    [(36, 32, 33.0, 66.1), (40, 40, 42.0, 83.9), (48, 40, 50.3, 101)],
)
def test_parameter_count_reproduces_the_released_checkpoint_sizes(
    layers, heads, total_m, megabytes
):
    # The paper's sizes: Qwen3-4B/8B, Qwen3-14B and R1-Distill-Qwen-14B gates in bf16.
    config = Qwen3Config(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        hidden_size=5120,
    )
    gate = GateConfig.for_model(config)  # defaults: gate_dim 128, qk_norm on
    per_layer = gate_parameter_count(
        gate.num_heads, gate.num_kv_heads, gate.head_dim, gate.gate_dim, gate.qk_norm
    )
    if heads == 32:
        assert per_layer == 917_760
    total = per_layer * gate.num_layers
    assert round(total / 1e6, 1) == total_m
    assert round(2 * total / 1e6, 1 if megabytes < 100 else 0) == megabytes


@pytest.mark.parametrize("qk_norm", [True, False])
def test_module_holds_the_counted_parameters(qk_norm):
    gate = tiny_gate(qk_norm)
    # Spelled out: 2 KV heads x (2 heads x 8 dims) -> 6, 2 x (3 x 8) -> 6, two norms of 6.
    expected = 2 * 16 * 6 + 2 * 24 * 6 + (12 if qk_norm else 0)
    assert sum(p.numel() for p in gate.parameters()) == expected
    assert gate_parameter_count(4, 2, 8, 6, qk_norm) == expected
    assert gate.q_weight.shape == (2, 16, 6) and gate.k_weight.shape == (2, 24, 6)


# -- families --


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_and_config_come_from_the_model(family):
    model = tiny_model(family)
    assert model_family(model) == family
    config = GateConfig.for_model(model.config, block_size=16, gate_dim=32, base_model="m")
    assert (config.family, config.num_layers, config.num_heads, config.num_kv_heads) == (
        family,
        2,
        4,
        2,
    )
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (8, 10000.0, None)
    assert (config.block_size, config.gate_dim, config.base_model) == (16, 32, "m")


def test_other_families_and_bad_configs_are_refused():
    with pytest.raises(ValueError, match="model_type is 'gpt2'"):
        model_family(GPT2Config())
    with pytest.raises(ValueError, match="gate_dim must be even"):
        GateConfig.for_model(LlamaConfig(**TINY), gate_dim=7)
    with pytest.raises(TypeError, match="unknown overrides"):
        GateConfig.for_model(LlamaConfig(**TINY), head_dim=4)
    with pytest.raises(ValueError, match="3 heads of dim 8"):
        tiny_gate().query(torch.zeros(1, 3, 5, 8), torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_pre_rope_equals_the_projections_by_hand(family):
    model = tiny_model(family)
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), capture_pre_rope(model) as captured:
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert len(captured) == 2
    for layer, store, x in zip(model.model.layers, captured, hidden, strict=False):
        attn = layer.self_attn
        with torch.no_grad():
            normed = layer.input_layernorm(x)
            q = attn.q_proj(normed).view(2, 11, 4, 8)
            k = attn.k_proj(normed).view(2, 11, 2, 8)
            if family == "qwen3":
                q, k = attn.q_norm(q), attn.k_norm(k)
        torch.testing.assert_close(store["q"], q.transpose(1, 2))
        torch.testing.assert_close(store["k"], k.transpose(1, 2))
    # The hooks are gone afterwards.
    for layer in model.model.layers:
        attn = layer.self_attn
        hooked = (attn.q_proj, attn.k_proj) + (
            (attn.q_norm, attn.k_norm) if family == "qwen3" else ()
        )
        assert not any(m._forward_hooks for m in hooked)


# -- RoPE --


def test_rotation_by_p_then_minus_p_is_identity_and_scores_depend_on_distance():
    gate = tiny_gate()
    x = torch.randn(1, 2, 5, 6)
    p = torch.tensor([[0, 3, 17, 64, 1000]])
    torch.testing.assert_close(gate.rotate(gate.rotate(x, p), -p), x, atol=1e-4, rtol=1e-4)
    q, k = torch.randn(1, 1, 1, 6), torch.randn(1, 1, 1, 6)

    def score(m: int, n: int) -> float:
        return (gate.rotate(q, torch.tensor([[m]])) * gate.rotate(k, torch.tensor([[n]]))).sum()

    torch.testing.assert_close(score(10, 3), score(107, 100), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 5000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_gate_rope_equals_transformers_rope_over_gate_dims(rope):
    base = LlamaConfig(**TINY, rope_parameters=rope, max_position_embeddings=512)
    gate = AttnGate(GateConfig.for_model(base, gate_dim=16))
    # transformers' own rotary for a model whose head is the gate's 16 dims.
    reference = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=16,
            num_attention_heads=1,
            head_dim=16,
            rope_parameters=rope,
            max_position_embeddings=512,
        )
    )
    x = torch.randn(2, 3, 5, 16)
    positions = torch.tensor([[0, 1, 63, 64, 400], [5, 6, 7, 8, 9]])
    cos, sin = reference(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(gate.rotate(x, positions), expected, atol=1e-5, rtol=1e-5)


def _rope_by_hand(v: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    half = v.shape[0] // 2
    out = torch.empty_like(v)
    for i in range(half):
        angle = position * theta ** (-2 * i / v.shape[0])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = v[i] * c - v[i + half] * s
        out[i + half] = v[i + half] * c + v[i] * s
    return out


def _rms_by_hand(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt((v**2).mean() + 1e-6) * weight


def test_gate_key_of_a_block_and_gate_query_by_hand():
    gate = tiny_gate()
    k = torch.randn(1, 2, 10, 8)  # blocks [0,4), [4,8), [8,10)
    q = torch.randn(1, 4, 10, 8)
    starts = torch.tensor([[0, 4, 8]])
    with torch.no_grad():
        keys = gate.keys(gate.pool(k), starts)
        queries = gate.query(q, torch.arange(10)[None])
    for head in range(2):
        for block, start in enumerate((0, 4, 8)):
            tokens = k[0, head, start : start + 4]
            pooled = torch.cat((tokens.max(0).values, tokens.min(0).values, tokens.mean(0)))
            projected = pooled @ gate.k_weight[head].detach()
            normed = _rms_by_hand(projected, gate.k_norm.weight.detach())
            expected = _rope_by_hand(normed, start, 10000.0)
            torch.testing.assert_close(keys[0, head, block], expected, atol=1e-5, rtol=1e-5)
        # The query of KV head h concatenates query heads 2h and 2h+1, in that order.
        t = 7
        features = torch.cat((q[0, 2 * head, t], q[0, 2 * head + 1, t]))
        normed = _rms_by_hand(features @ gate.q_weight[head].detach(), gate.q_norm.weight.detach())
        expected = _rope_by_hand(normed, t, 10000.0)
        torch.testing.assert_close(queries[0, head, t], expected, atol=1e-5, rtol=1e-5)


def test_logits_scale_and_invalid_blocks():
    gate = tiny_gate()
    gq, gk = torch.randn(2, 2, 3, 6), torch.randn(2, 2, 4, 6)
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    logits = gate.logits(gq, gk, valid)
    assert logits.shape == (2, 2, 3, 4)
    assert torch.isneginf(logits[0, :, :, 0]).all()
    expected = (gq[1, 1, 2] * gk[1, 1, 3]).sum() / math.sqrt(6)
    torch.testing.assert_close(logits[1, 1, 2, 3], expected)


# -- pooling --


def test_pool_with_partial_last_block_and_padding():
    gate = tiny_gate()
    k = torch.randn(2, 2, 11, 8)  # blocks of 4: [0,4), [4,8), [8,11) partial
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[0, :6] = False  # left padding: block 0 empty, block 1 half valid
    pooled = gate.pool(k, valid)
    assert pooled.shape == (2, 2, 3, 24)
    for b in range(2):
        for h in range(2):
            for block in range(3):
                idx = [t for t in range(block * 4, min(block * 4 + 4, 11)) if valid[b, t]]
                if not idx:
                    expected = torch.zeros(24)
                else:
                    tokens = k[b, h, idx]
                    expected = torch.cat(
                        (tokens.max(0).values, tokens.min(0).values, tokens.mean(0))
                    )
                torch.testing.assert_close(pooled[b, h, block], expected)
    with pytest.raises(ValueError, match="valid has shape"):
        gate.pool(k, valid[:, :5])


# -- save / load --


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen3")
    gates = SeerGates(GateConfig.for_model(model.config, block_size=4, gate_dim=6))
    for gate in gates:
        with torch.no_grad():
            gate.q_norm.weight.uniform_(0.5, 1.5)
    gates.save(tmp_path / "g")
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        "gate_config.json",
        "gate_weights.safetensors",
    ]
    loaded = SeerGates.load(tmp_path / "g")
    assert loaded.config == gates.config and len(loaded) == 2
    for a, b in zip(gates.state_dict().values(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(FileNotFoundError, match="gate_config.json"):
        SeerGates.load(tmp_path)
