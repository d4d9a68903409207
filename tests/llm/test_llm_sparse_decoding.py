"""SeerAttention-R sparse decoding in the transformers backend, on a tiny random Llama (2 layers,
4 query / 2 KV heads, head_dim 16) with random gates of block size 16.

- Through TransformersLLM: a budget covering the whole context generates exactly what dense
  decoding does, for left-padded prompts of different lengths crossing several blocks.
- Token level: every decode step's logits equal those of one full-sequence forward whose attention
  is masked, per layer and KV head, to the blocks the gates pick from full-sequence scores.
- Small budgets stay near dense; the Triton kernel (interpreted on a CPU) matches PyTorch.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rstar_kernels.gate import GateConfig, SeerGates, capture_pre_rope
from rstar_kernels.hf import cache_argument, enable_seer_decoding
from rstar_pipelines.llm import SamplingParams, load_llm
from rstar_pipelines.llm.cpu.cascade_attention import ATTENTION_NAME as CASCADE_ATTENTION
from rstar_pipelines.llm.cpu.quantized_linear import Int4Linear, Int8Linear
from rstar_pipelines.llm.resource import LLMResource
from tests.fakes.llm import TRANSFORMERS

BLOCK = 16
CHARS = "abcdefghijklmnopqrstuvwxyz .,"
# One prompt is a single token: with n samples its row holds only padding at the shared prefill.
PROMPTS = ["the cat", "a longer prompt, with commas, to pad against.", "mid sized prompt", "x"]
# Prompt width 40 (pads 0, 13, 30) and 60 decode steps: blocks 3..6 start while decoding.
PADS, WIDTH, TOTAL = [0, 13, 30], 40, 100


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; no EOS, so generation runs to max_tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, gates dir, the model, its gates)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(CHARS) + 2,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        # Wider than the default 0.02, so attention is peaked enough for block choices to matter.
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    # Never <pad> or <unk>: a completion ends at the first <pad>, and these should run to the end.
    model.generation_config.suppress_tokens = [0, 1]
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    gates = SeerGates(GateConfig.for_model(config, block_size=BLOCK, gate_dim=32)).eval()
    gates_dir = gates.save(tmp_path_factory.mktemp("gates"))
    return str(model_dir), str(gates_dir), model, gates


def sequence():
    """A left-padded batch of random tokens: ids, attention mask, generate()-style position ids."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, len(CHARS) + 2, (len(PADS), TOTAL), generator=gen)
    t = torch.arange(TOTAL)
    starts = torch.tensor(PADS)
    mask = (t >= starts[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, (t - starts[:, None]).clamp(min=0), starts


def test_the_cache_goes_by_the_keyword_the_installed_model_takes(tiny):
    """transformers 5.24 renamed `past_key_values` to `cache`; a model of either side swallows
    the other name in its **kwargs and would run without the cache it was handed."""

    class Before:
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class After:
        def forward(self, input_ids, cache=None, **kwargs): ...

    cache = object()
    assert cache_argument(Before(), cache) == {"past_key_values": cache}
    assert cache_argument(After(), cache) == {"cache": cache}
    model = tiny[2]
    for module in (model, model.get_decoder()):
        (name,) = cache_argument(module, cache)
        assert name in inspect.signature(type(module).forward).parameters


@torch.no_grad()
def step_logits(model, ids, mask, positions, width=WIDTH):
    """Logits [B, T - width + 1, V]: a prefill of ids[:, :width], then one token per forward."""
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids[:, :width],
        attention_mask=mask[:, :width],
        position_ids=positions[:, :width],
        cache=cache,
        use_cache=True,
    )
    logits = [out.logits[:, -1]]
    for t in range(width, ids.shape[1]):
        out = model(
            input_ids=ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            position_ids=positions[:, t : t + 1],
            **cache_argument(model, cache),
            use_cache=True,
        )
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.fixture(scope="module")
def dense_steps(tiny):
    _, _, model, _ = tiny
    ids, mask, positions, _ = sequence()
    return step_logits(model, ids, mask, positions)


# -- the independent reference: one full-sequence forward, attention masked to picked blocks --


def picked_blocks(scores, t, start, keep):
    """Blocks query t reads: its own, the first valid one, and the top `keep` blocks between."""
    current, first = t // BLOCK, start // BLOCK
    between = list(range(first + 1, current))
    ranked = sorted(between, key=lambda j: -scores[j].item())
    return {current, first, *ranked[:keep]}


def oracle_masks(gate, q, k, starts, positions, keep):
    """bool [B, H_q, T, T]: dense causal attention over valid tokens for prompt rows; for decode
    rows only the picked blocks, scored by the gate on the full sequence."""
    batch, _, total, _ = k.shape
    heads, kv_heads = q.shape[1], k.shape[1]
    t = torch.arange(total)
    valid = t >= starts[:, None]
    blocks = total // BLOCK
    first_valid = torch.maximum(torch.arange(blocks) * BLOCK, starts[:, None])
    block_pos = (first_valid - starts[:, None]).clamp(min=0)
    gk = gate.keys(gate.pool(k[:, :, : blocks * BLOCK], valid[:, : blocks * BLOCK]), block_pos)
    scores = gate.logits(gate.query(q, positions), gk)  # [B, H_kv, T, blocks]
    allowed = (t[None, :, None] >= t[None, None, :]) & valid[:, None, :]  # [B, T, T]
    # A padding query sees only itself, so no row is empty (an empty row would make NaNs).
    allowed = allowed | (torch.eye(total, dtype=torch.bool) & ~valid[:, :, None])
    mask = allowed[:, None].repeat(1, kv_heads, 1, 1)
    for b in range(batch):
        start = int(starts[b])
        for h in range(kv_heads):
            for row in range(WIDTH, total):
                chosen = picked_blocks(scores[b, h, row], row, start, keep)
                in_block = torch.tensor([s // BLOCK in chosen for s in range(total)])
                mask[b, h, row] &= in_block
    return mask.repeat_interleave(heads // kv_heads, dim=1)


@torch.no_grad()
def oracle_logits(model, gates, ids, mask, positions, starts, keep, start_layer):
    masks: dict[int, torch.Tensor] = {}

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        if layer not in masks:
            q, k = captured[layer]["q"], captured[layer]["k"]
            if layer >= start_layer:
                masks[layer] = oracle_masks(gates[layer], q, k, starts, positions, keep)
            else:
                masks[layer] = oracle_masks(gates[layer], q, k, starts, positions, TOTAL)
        return sdpa_attention_forward(
            module, query, key, value, masks[layer], scaling=scaling, **kwargs
        )

    AttentionInterface.register("seer_test_oracle", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("seer_test_oracle")
    try:
        with capture_pre_rope(model) as captured:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    finally:
        model.set_attn_implementation(previous)
    return logits[:, WIDTH - 1 :]


@pytest.mark.parametrize(("keep", "start_layer"), [(0, 0), (1, 0), (2, 1)])
def test_decode_steps_read_exactly_the_blocks_the_gates_pick(tiny, dense_steps, keep, start_layer):
    _, _, model, gates = tiny
    ids, mask, positions, starts = sequence()
    with enable_seer_decoding(model, gates, token_budget=keep * BLOCK, start_layer=start_layer):
        got = step_logits(model, ids, mask, positions)
    want = oracle_logits(model, gates, ids, mask, positions, starts, keep, start_layer)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The restriction matters: dense decoding gives other logits.
    assert (got - dense_steps).abs().max() > 0.1


@pytest.mark.parametrize("setting", [{"token_budget": TOTAL}, {"threshold": 0.0}])
def test_keeping_every_block_equals_dense_decoding(tiny, dense_steps, setting):
    _, _, model, gates = tiny
    ids, mask, positions, _ = sequence()
    with enable_seer_decoding(model, gates, **setting):
        got = step_logits(model, ids, mask, positions)
    torch.testing.assert_close(got, dense_steps, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == "sdpa"


def mean_key_gates(model, sign=1.0) -> SeerGates:
    """Quest-like gates built by hand: a block's score is the sum of the group's pre-RoPE queries
    dotted with the block's mean pre-RoPE key, rotated as the model rotates (gate_dim = head_dim,
    same theta). `sign=-1` reverses their ranking."""
    gates = SeerGates(
        GateConfig.for_model(model.config, block_size=BLOCK, gate_dim=16, qk_norm=False)
    )
    eye = torch.eye(16)
    with torch.no_grad():
        for gate in gates:
            gate.q_weight.copy_(sign * torch.cat([eye, eye]).expand(2, 32, 16))
            gate.k_weight.zero_()
            gate.k_weight[:, 32:48] = eye  # the mean third of [max, min, mean]
    return gates.eval()


def test_small_budgets_stay_near_dense(tiny, dense_steps):
    """Teacher-forced on the same tokens; context 40..100 tokens (3..7 blocks). Measured mean KL
    (dense || sparse) per step: mean-key gates 0.58 / 0.058 at budgets 16 / 48 (max |dlogit| 7.7 /
    3.9); their reversed ranking 0.111 at 48; the random gates 0.096 at 48. Random weights give
    broad attention, so a 3-of-7-block budget is not near-lossless here as it is for trained
    gates on real reasoning traces."""
    _, _, model, _ = tiny
    ids, mask, positions, _ = sequence()
    dense = dense_steps.log_softmax(-1)

    def kl_and_max(gates, budget):
        with enable_seer_decoding(model, gates, token_budget=budget):
            sparse = step_logits(model, ids, mask, positions).log_softmax(-1)
        kl = (dense.exp() * (dense - sparse)).sum(-1).mean().item()
        return kl, (sparse - dense).abs().max().item()

    informed = mean_key_gates(model)
    kl_16, _ = kl_and_max(informed, 16)
    kl_48, max_48 = kl_and_max(informed, 48)
    kl_reversed, _ = kl_and_max(mean_key_gates(model, sign=-1.0), 48)
    assert kl_48 < 0.08
    assert max_48 < 5.0
    assert kl_48 < kl_16 / 4
    # Reading the highest-scoring blocks, not just any blocks, is what keeps it close.
    assert kl_48 < 0.7 * kl_reversed


# -- through TransformersLLM and the Dagster resource --


def sparse_llm(tiny, **options):
    model_dir, gates_dir, _, _ = tiny
    settings = {"sparse_attention": "seer", "gate_checkpoint": gates_dir, **options}
    return load_llm("transformers", model_dir, batch_size=4, device="cpu", **settings)


def test_generate_with_a_budget_covering_the_context_equals_dense(tiny):
    model_dir = tiny[0]
    dense = load_llm("transformers", model_dir, batch_size=4, device="cpu")
    # Prompts of 1..46 tokens, 60 new ones: blocks 3..6 start while decoding.
    greedy = SamplingParams(temperature=0, max_tokens=60)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=3)
    before = dense.generate(PROMPTS, greedy)
    sparse = sparse_llm(tiny, token_budget=4096, sparse_backend="torch")
    assert sparse.name.startswith(f"{TRANSFORMERS}:{model_dir}+seer(budget=4096,gates=")
    assert sparse._model is not dense._model
    assert sparse._model.config._attn_implementation == "seer"
    assert sparse.generate(PROMPTS, greedy) == before
    assert all(c.completion_tokens == 60 for [c] in before)
    # n samples share one prefill, then each row's compressed cache is repeated per sample.
    assert sparse.generate(PROMPTS, sampled) == dense.generate(PROMPTS, sampled)
    # The dense instance is untouched by the sparse one.
    assert dense._model.config._attn_implementation == CASCADE_ATTENTION
    assert dense.generate(PROMPTS, greedy) == before


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_covering_budget_equals_dense_on_a_quantized_model(tiny, scheme):
    # The gates read the pre-RoPE q and k from the quantized projections, hooked after quantizing.
    model_dir = tiny[0]
    dense = load_llm("transformers", model_dir, batch_size=4, device="cpu", quantization=scheme)
    sparse = sparse_llm(tiny, token_budget=4096, sparse_backend="torch", quantization=scheme)
    assert sparse.name.startswith(f"{TRANSFORMERS}:{model_dir}+{scheme}+seer(budget=4096,gates=")
    layer = Int4Linear if scheme == "int4" else Int8Linear
    assert isinstance(sparse._model.model.layers[0].self_attn.q_proj, layer)
    assert sparse._model.config._attn_implementation == "seer"
    greedy = SamplingParams(temperature=0, max_tokens=60)
    assert sparse.generate(PROMPTS, greedy) == dense.generate(PROMPTS, greedy)
    # Not sampled completions: the sparse kernel's float rounding differs from SDPA's, the
    # quantized layers' bfloat16 activations magnify it (up to about 0.1 in a logit), and a draw
    # near the edge of a token's share of the mass moves; the float32 test above compares samples.
    # Quantization changes the completions: these are not the float32 model's.
    float32 = load_llm("transformers", model_dir, batch_size=4, device="cpu")
    assert dense.generate(PROMPTS, greedy) != float32.generate(PROMPTS, greedy)


def test_a_small_budget_changes_the_completions(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=60)
    full = sparse_llm(tiny, token_budget=4096).generate(PROMPTS, greedy)
    small = sparse_llm(tiny, token_budget=0).generate(PROMPTS, greedy)
    assert small != full


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the model runs on the CPU here; on a GPU the kernels are checked in tests/kernels",
)
def test_triton_kernel_matches_torch(tiny):
    """The Triton kernel, interpreted on a CPU (slow: a short run)."""
    _, _, model, gates = tiny
    ids, mask, positions, _ = sequence()
    ids, mask, positions = ids[:, :56], mask[:, :56], positions[:, :56]  # crosses block 3
    logits = {}
    for backend in ("torch", "triton"):
        with enable_seer_decoding(model, gates, token_budget=BLOCK, backend=backend):
            logits[backend] = step_logits(model, ids, mask, positions)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_wrong_setups_get_clear_errors(tiny, tmp_path):
    model_dir, gates_dir, _, _ = tiny
    with pytest.raises(ValueError, match="needs gate_checkpoint"):
        load_llm("transformers", model_dir, sparse_attention="seer")
    with pytest.raises(ValueError, match="sparse_attention must be one of seer"):
        load_llm("transformers", model_dir, sparse_attention="quest", gate_checkpoint=gates_dir)
    with pytest.raises(ValueError, match="gate_checkpoint given without sparse_attention"):
        load_llm("transformers", model_dir, gate_checkpoint=gates_dir)
    with pytest.raises(ValueError, match="not both"):
        sparse_llm(tiny, token_budget=64, sparse_threshold=0.01)
    with pytest.raises(FileNotFoundError, match="SeerGates.save"):
        sparse_llm(tiny, gate_checkpoint=str(tmp_path))
    config = LlamaConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3
    )
    other = SeerGates(GateConfig.for_model(config, block_size=BLOCK, gate_dim=16))
    with pytest.raises(ValueError, match="do not fit the model: num_heads: gates 3, model 4"):
        sparse_llm(tiny, gate_checkpoint=str(other.save(tmp_path / "other")))


def test_resource_passes_sparse_settings_and_names_them(tiny, monkeypatch):
    model_dir, gates_dir, _, _ = tiny
    resource = LLMResource(
        model=model_dir,
        device="cpu",
        sparse_attention="seer",
        gate_checkpoint=gates_dir,
        sparse_threshold=0.01,
    )
    llm = resource.get_llm()
    assert llm.name == resource.model_id()
    assert resource.model_id().endswith(f"+seer(threshold=0.01,gates={gates_dir})")
    assert llm._model.config._attn_implementation == "seer"
    # Unset fields fall back to the environment; dense and sparse never share an id.
    monkeypatch.setenv("RSTAR_SPARSE_ATTENTION", "seer")
    monkeypatch.setenv("RSTAR_GATE_CHECKPOINT", gates_dir)
    from_env = LLMResource(model=model_dir)
    assert from_env.model_id() == f"{TRANSFORMERS}:{model_dir}+seer(budget=4096,gates={gates_dir})"
    monkeypatch.delenv("RSTAR_SPARSE_ATTENTION")
    monkeypatch.delenv("RSTAR_GATE_CHECKPOINT")
    assert LLMResource(model=model_dir).model_id() == f"{TRANSFORMERS}:{model_dir}"
    with pytest.raises(ValueError, match="runs in-process"):
        LLMResource(
            backend="openai",
            base_url="http://x/v1",
            sparse_attention="seer",
            gate_checkpoint=gates_dir,
        ).get_llm()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh)"
)
@pytest.mark.parametrize("kernel", ["triton", "tilelang"])
def test_sparse_generation_on_the_gpu(tiny, kernel):
    """On a GPU in fp16: the compiled kernel's decode steps match the PyTorch reference's, and
    TransformersLLM generates with it."""
    import copy

    model_dir, gates_dir, model, gates = tiny
    model = copy.deepcopy(model).to("cuda", torch.float16)
    gates = copy.deepcopy(gates).to("cuda")
    ids, mask, positions, _ = (t.cuda() for t in sequence())
    logits = {}
    for backend in ("torch", kernel):
        with enable_seer_decoding(model, gates, token_budget=2 * BLOCK, backend=backend):
            logits[backend] = step_logits(model, ids, mask, positions).float()
    torch.testing.assert_close(logits[kernel], logits["torch"], atol=2e-2, rtol=2e-2)
    llm = load_llm("transformers", model_dir, batch_size=4, device="cuda", dtype="float16",
                   sparse_attention="seer", gate_checkpoint=gates_dir, token_budget=2 * BLOCK,
                   sparse_backend=kernel)  # fmt: skip
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60))
    assert [c.completion_tokens for [c] in out] == [60] * len(PROMPTS)
