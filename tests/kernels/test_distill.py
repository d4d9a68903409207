"""Gate self-distillation: the target against brute-force loops and the model's own attention
weights, the KL loss and top-k recall by hand, and a short training run that learns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rstar_kernels import distill
from rstar_kernels.distill import (
    GateTrainConfig,
    distillation_target,
    gate_kl_loss,
    gate_outputs,
    sequence_loss,
    teacher_pass,
    topk_recall,
    train_gates,
)
from rstar_kernels.gate import GateConfig, SeerGates


def brute_force_target(q, k, num_kv_heads, block_size, valid):
    """Loops in float64: causal softmax per query head, block max, group max, earlier blocks,
    renormalised."""
    b_, h_q, t_, d = q.shape
    group = h_q // num_kv_heads
    n = math.ceil(t_ / block_size)
    target = torch.zeros(b_, num_kv_heads, t_, n, dtype=torch.float64)
    rows = torch.zeros(b_, t_, dtype=torch.bool)
    for b in range(b_):
        for t in range(t_):
            keys = [s for s in range(t + 1) if valid[b, s]]
            earlier = [s for s in keys if s // block_size < t // block_size]
            rows[b, t] = bool(valid[b, t] and earlier)
            for h in range(num_kv_heads):
                best = torch.zeros(n, dtype=torch.float64)
                for i in range(h * group, (h + 1) * group):
                    scores = torch.tensor(
                        [float(q[b, i, t].double() @ k[b, h, s].double()) / d**0.5 for s in keys]
                    )
                    probs = torch.softmax(scores, 0) if keys else scores
                    for s, p in zip(keys, probs, strict=True):
                        j = s // block_size
                        if j < t // block_size:
                            best[j] = max(best[j], p)
                target[b, h, t] = best / (best.sum() + 1e-9)
    return target, rows


@pytest.mark.parametrize("chunk", [512, 5])
def test_target_matches_brute_force(monkeypatch, chunk):
    monkeypatch.setattr(distill, "TARGET_CHUNK", chunk)  # query chunks must not change a thing
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 19, 8, generator=gen) * 2
    k = torch.randn(2, 2, 19, 8, generator=gen) * 2
    valid = torch.ones(2, 19, dtype=torch.bool)
    valid[1, :6] = False  # left padding: row 1's block 0 is empty, block 1 half valid
    target, rows = distillation_target(q, k, 2, 4, valid)
    expected, expected_rows = brute_force_target(q, k, 2, 4, valid)
    assert target.shape == (2, 2, 19, 5)
    assert torch.equal(rows, expected_rows)
    assert not rows[0, :4].any() and rows[0, 4:].all()
    assert not rows[1, :8].any() and rows[1, 8:].all()  # block 1 has valid keys 6, 7
    torch.testing.assert_close(
        target[rows[:, None].expand_as(target[..., 0])],
        expected[rows[:, None].expand_as(expected[..., 0])].float(),
        atol=1e-5,
        rtol=1e-4,
    )
    sums = target.sum(-1)[:, :, 4:][rows[:, None, 4:].expand(2, 2, 15)]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-6, rtol=0)


def _eager_llama(scale: float = 1.0, theta: float = 10000.0) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the tiny init gives, so blocks differ
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


def test_target_from_captured_qk_equals_pooling_the_models_attention_weights():
    # The model's eager attention returns its softmax probabilities: pooling them by hand is an
    # independent check that the captured pre-RoPE q/k were rotated as the model does.
    model = _eager_llama(scale=5.0, theta=500.0)
    ids = torch.randint(0, 64, (1, 45), generator=torch.Generator().manual_seed(1))
    gates = SeerGates(GateConfig.for_model(model.config, block_size=8, gate_dim=16))
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
        layers = gate_outputs(gates, teacher_pass(model, ids[0], gates.config), first_row=20)
    for attn, (logits, target, rows) in zip(attentions, layers, strict=True):
        padded = torch.nn.functional.pad(attn, (0, 3))  # 45 -> 48 keys, 6 blocks
        pooled = padded.view(1, 2, 2, 45, 6, 8).amax(dim=(2, 5))
        own = torch.arange(45)[:, None] // 8
        pooled = pooled * (torch.arange(6)[None] < own)
        pooled = pooled / (pooled.sum(-1, keepdim=True) + 1e-9)
        assert torch.equal(rows[0], torch.arange(45) >= 20)
        torch.testing.assert_close(target[:, :, 8:], pooled[:, :, 8:], atol=1e-5, rtol=1e-4)
        # The gate's logits are -inf exactly where the target has no support.
        assert torch.equal(torch.isfinite(logits[0, 0]), torch.arange(6)[None] < own)


def test_kl_loss_by_hand_and_its_gradient_is_finite():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 2, 3, 4, generator=gen)
    logits[..., 3] = -math.inf  # block 3 is not a candidate
    logits[:, :, 0, 1:] = -math.inf
    target = torch.rand(1, 2, 3, 4, generator=gen)
    target[..., 3] = 0.0
    target[:, :, 0, 1:] = 0.0
    target[0, 1, 2, 0] = 0.0  # a zero inside the support
    target = target / target.sum(-1, keepdim=True)
    rows = torch.tensor([[False, True, True]])
    logits.requires_grad_(True)
    loss = gate_kl_loss(logits, target, rows)
    expected = []
    for h in range(2):
        for t in (1, 2):
            log_q = torch.log_softmax(logits[0, h, t].detach().double(), 0)
            p = target[0, h, t].double()
            expected.append(sum(p[j] * (p[j].log() - log_q[j]) for j in range(3) if p[j] > 0))
    torch.testing.assert_close(loss.double(), torch.stack(expected).mean(), atol=1e-6, rtol=0)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, :, 0].abs().sum() == 0
    with pytest.raises(ValueError, match="no row contributes"):
        gate_kl_loss(logits, target, torch.zeros(1, 3, dtype=torch.bool))


def test_topk_recall_by_hand():
    inf = math.inf
    logits = torch.tensor([[[[3.0, 2.0, 1.0, 0.0, -inf], [1.0, 2.0, -inf, -inf, -inf]]]])
    target = torch.tensor([[[[0.1, 0.5, 0.4, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0, 0.0]]]])
    rows = torch.tensor([[True, True]])
    # Row 0: truth {1, 2}, gate {0, 1} -> 1/2. Row 1 has only 2 candidates: not counted.
    assert topk_recall(logits, target, rows, 2).tolist() == [0.5]
    # k = 1: row 0 truth {1} vs gate {0}; row 1 truth {0} vs gate {1}.
    assert topk_recall(logits, target, rows, 1).tolist() == [0.0, 0.0]


def test_train_config_refuses_bad_values():
    with pytest.raises(ValueError, match="loss_slice_ratio"):
        GateTrainConfig(loss_slice_ratio=1.0)
    with pytest.raises(ValueError, match="max_length must exceed block_size"):
        GateTrainConfig(max_length=64, block_size=64)
    with pytest.raises(ValueError, match="lr must be positive"):
        GateTrainConfig(lr=0)


class DigitTokenizer:
    """Whitespace-separated integers are the token ids."""

    def __call__(self, texts, truncation, max_length):
        return {"input_ids": [[int(w) for w in t.split()][:max_length] for t in texts]}


def _texts(count: int, length: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    return [
        " ".join(str(int(x)) for x in torch.randint(0, 64, (length,), generator=gen))
        for _ in range(count)
    ]


def test_loss_counts_only_the_second_half_of_a_text():
    model = _eager_llama(scale=5.0)
    gates = SeerGates(GateConfig.for_model(model.config, block_size=8, gate_dim=16))
    ids = torch.randint(0, 64, (41,), generator=torch.Generator().manual_seed(4))
    config = GateTrainConfig(block_size=8, gate_dim=16, max_length=64, loss_slice_ratio=0.5)
    teacher = teacher_pass(model, ids, gates.config)
    got = sequence_loss(gates, teacher, config)
    full = gate_outputs(gates, teacher)
    expected = 0.0
    for logits, target, rows in full:
        rows = rows.clone()
        rows[:, :21] = False  # ceil(0.5 * 41)
        expected += gate_kl_loss(logits, target, rows)
    torch.testing.assert_close(got, 10 * expected)


def test_training_lowers_the_loss_and_raises_heldout_recall():
    model = _eager_llama(scale=5.0)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    config = GateTrainConfig(
        lr=3e-2,
        warmup_steps=4,
        steps=60,
        max_length=256,
        block_size=16,
        gate_dim=32,
        heldout_fraction=0.25,
        topk_blocks=4,
    )
    texts = [*_texts(12, 256, seed=1), "1 2 3"]  # the last is shorter than a block
    messages = []
    gates, metrics = train_gates(model, DigitTokenizer(), texts, config, messages.append)
    losses = metrics["losses"]
    assert metrics["steps"] == len(losses) == 60
    assert (metrics["examples"], metrics["heldout_examples"], metrics["skipped_short"]) == (9, 3, 1)
    held = metrics["heldout_texts"]
    assert len(set(held)) == 3 and 12 not in held and all(0 <= i < 12 for i in held)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:5]) / 5
    before, after = metrics["heldout_recall_before"], metrics["heldout_recall_after"]
    assert after > before + 0.04, (before, after)
    assert messages[0].startswith("training 2 gates on 9 texts")
    assert all(
        torch.equal(p, weights[n]) and not p.requires_grad for n, p in model.named_parameters()
    )
    assert isinstance(gates, SeerGates) and gates.config.block_size == 16


def test_cached_teacher_passes_train_the_same_gates():
    config = GateTrainConfig(steps=8, warmup_steps=2, max_length=64, block_size=8, gate_dim=16)
    runs = [
        train_gates(
            _eager_llama(scale=5.0),
            DigitTokenizer(),
            _texts(3, 64, seed=2),
            dataclasses.replace(config, cache_teacher=cached),
            print,
            base_model="tiny",
        )
        for cached in (False, True)
    ]
    (plain, plain_metrics), (cached, cached_metrics) = runs
    assert plain_metrics["losses"] == cached_metrics["losses"]
    assert (plain_metrics["examples"], plain_metrics["heldout_examples"]) == (2, 1)
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(a, b)
    assert cached.config.base_model == "tiny"


def test_training_refuses_texts_that_are_all_too_short():
    with pytest.raises(ValueError, match="longer than one block"):
        train_gates(
            _eager_llama(),
            DigitTokenizer(),
            ["1 2 3"],
            GateTrainConfig(block_size=16, max_length=64),
            print,
        )
