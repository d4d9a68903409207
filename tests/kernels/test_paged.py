"""The paged decode path on KV caches laid out exactly as vLLM 0.32.0 lays them out, against the
contiguous path built from the same keys: compressed gate keys, selected blocks and attention
output must agree. Where vLLM does what the helpers below copy: rstar_kernels/vllm_layout.py."""

from __future__ import annotations

import copy
from math import prod

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rstar_kernels import sparse_decode_reference
from rstar_kernels.cache import CompressedKeyCache
from rstar_kernels.gate import GateConfig, SeerGates
from rstar_kernels.host_sync import count_host_syncs
from rstar_kernels.paged import HeadRotary, PagedGateKeys, gather_selected, paged_sparse_decode
from rstar_kernels.selection import select_blocks
from rstar_kernels.vllm_layout import (
    SeerLayer,
    Selection,
    check_layer_heads,
    plugin_memory,
    sparse_kv_cache_dtype,
    split_kv_cache,
)
from rstar_kernels.vllm_plugin import BUDGET_ENV, GATE_ENV, THRESHOLD_ENV, settings_from_env

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 16
NUM_BLOCKS = 40
# vllm/v1/kv_cache_layout.py lines 23-24: stride orders over the logical [L, B, H, N, C] axes.
# LBNHC is the default when no backend declares a layout (FlashAttention declares none).
LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4)}


def vllm_kv_caches(num_layers, layout, dtype=torch.float32, num_blocks=NUM_BLOCKS):
    """Per-layer caches as vLLM 0.32.0 allocates them (vllm/v1/kv_cache_interface.py): the
    logical shape (L, num_blocks, H_kv, block_size, C) with C = 2·head_size in bytes
    (`compute_layer_kv_cache_shape_bytes`, lines 319-335), strides laid out in the layout's order
    (`compute_layout_strides`, lines 338-374), one as_strided view of a flat int8 buffer, each
    layer viewed as the cache dtype (`create_kv_cache_views`, lines 377-441). Filled with NaN,
    so a read of an unwritten slot shows."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (num_layers, num_blocks, KV_HEADS, BLOCK, 2 * DIM * itemsize)
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= shape[dim]
    raw = torch.empty(prod(shape), dtype=torch.int8)
    views = [torch.as_strided(raw, shape, strides)[i].view(dtype) for i in range(num_layers)]
    for view in views:
        view.fill_(float("nan"))
    return views


def write_kv(kv_cache, key, value, slot_mapping):
    """What vLLM's cache write does (triton_reshape_and_cache_flash.py lines 60-67 and the
    split of flash_attn.py line 1443): token i goes to page slot // block_size, offset
    slot % block_size; slot -1 is padding."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(DIM, dim=-1)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // BLOCK, slot % BLOCK] = key[i]
            value_cache[slot // BLOCK, slot % BLOCK] = value[i]


def _model_config(rope_scaling=None):
    config = LlamaConfig(
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=1,
        max_position_embeddings=1024,
    )
    if rope_scaling:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    return config


def _gate(rope_scaling=None):
    model_config = _model_config(rope_scaling)
    config = GateConfig.for_model(model_config, block_size=BLOCK, gate_dim=16)
    return model_config, config, SeerGates(config)[0]


def _rotate(model_config, x, positions):
    """Post-RoPE x [B, H, L, D] by transformers' own Llama RoPE."""
    cos, sin = LlamaRotaryEmbedding(model_config)(x, positions)
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class Requests:
    """Random pre-RoPE keys, values and queries of a batch, their post-RoPE versions, and a
    vLLM block table of random distinct pages (as vLLM's allocator hands them out)."""

    def __init__(self, model_config, seq_lens, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        batch, length = len(seq_lens), max(seq_lens)
        positions = torch.arange(length).expand(batch, length)
        self.k_pre = torch.randn(batch, KV_HEADS, length, DIM, generator=g)
        self.v = torch.randn(batch, KV_HEADS, length, DIM, generator=g)
        self.q_pre = torch.randn(batch, HEADS, DIM, generator=g)
        self.k_post = _rotate(model_config, self.k_pre, positions)
        last = (self.seq_lens - 1).long()
        self.q_post = torch.stack(
            [
                _rotate(model_config, self.q_pre[i : i + 1, :, None], last[i : i + 1, None])[
                    0, :, 0
                ]
                for i in range(batch)
            ]
        )
        pages = -(-length // BLOCK)
        order = torch.randperm(NUM_BLOCKS, generator=g)[: batch * pages]
        self.block_table = order.view(batch, pages).to(torch.int32)

    def at(self, model_config, lens):
        """The same requests cut to `lens` tokens (their queries at the last of them)."""
        cut = copy.copy(self)
        cut.seq_lens = torch.tensor(lens, dtype=torch.int32)
        cut.q_post = torch.stack(
            [
                _rotate(model_config, self.q_pre[i : i + 1, :, None], torch.tensor([[n - 1]]))[
                    0, :, 0
                ]
                for i, n in enumerate(lens)
            ]
        )
        return cut

    def slots(self, row, start, end):
        """vLLM's slot mapping of positions start..end-1 of a row (block_table.py line 374)."""
        positions = torch.arange(start, end)
        return self.block_table[row, positions // BLOCK].long() * BLOCK + positions % BLOCK

    def write(self, kv_cache, layer=None, upto=None):
        """Write every row's tokens (up to `upto` of each) through vLLM's slot mapping, telling
        `layer` about each write as vLLM's cache update would."""
        for row, n in enumerate(self.seq_lens.tolist()):
            n = n if upto is None else min(n, upto[row])
            slots = self.slots(row, 0, n)
            keys, values = (
                self.k_post[row, :, :n].transpose(0, 1),
                self.v[row, :, :n].transpose(0, 1),
            )
            write_kv(kv_cache, keys, values, slots)
            if layer is not None:
                layer.mark_written(kv_cache, slots)

    def expected(self, gate, mode):
        """The contiguous path: what the transformers backend computes (no padding here)."""
        indices = []
        for row, n in enumerate(self.seq_lens.tolist()):
            cache = CompressedKeyCache(gate)
            cache.prefill(self.k_pre[row : row + 1, :, :n])
            gq = gate.query(self.q_pre[row : row + 1, :, None], torch.tensor([[n - 1]]))
            logits = gate.logits(gq, cache.keys)[:, :, 0]
            indices.append(select_blocks(logits, -(-n // BLOCK), 0, block_size=BLOCK, **mode))
        width = max(i.shape[-1] for i in indices)
        padded = [torch.nn.functional.pad(i, (0, width - i.shape[-1]), value=-1) for i in indices]
        return sparse_decode_reference(
            self.q_post, self.k_post, self.v, torch.cat(padded), self.seq_lens, BLOCK
        )


MODES = [{"token_budget": 2 * BLOCK}, {"threshold": 0.05}]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_sparse_decode_on_vllm_layout_matches_contiguous(layout, mode, rope_scaling):
    model_config, _, gate = _gate(rope_scaling)
    requests = Requests(model_config, [7 * BLOCK + 5, 4 * BLOCK, 1])
    [kv_cache] = vllm_kv_caches(1, layout)
    layer = SeerLayer(gate, Selection(mode.get("token_budget"), mode.get("threshold"), "torch"))
    requests.write(kv_cache, layer)

    out = layer.decode(
        requests.q_post, kv_cache, requests.block_table, requests.seq_lens, DIM**-0.5
    )

    torch.testing.assert_close(out, requests.expected(gate, mode), atol=2e-5, rtol=2e-5)
    # The compressed keys of row 0's full pages equal the contiguous cache's.
    cache = CompressedKeyCache(gate)
    cache.prefill(requests.k_pre[:1, :, : int(requests.seq_lens[0])])
    full = int(requests.seq_lens[0]) // BLOCK
    gate_keys = layer.gate_keys(kv_cache)
    torch.testing.assert_close(
        gate_keys.keys[requests.block_table[0, :full].long()].transpose(0, 1),
        cache.keys[0],
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_views_are_vllms_and_pages_are_counted_by_blocks(layout):
    [kv_cache] = vllm_kv_caches(1, layout)
    assert kv_cache.shape == (NUM_BLOCKS, KV_HEADS, BLOCK, 2 * DIM)
    key_cache, value_cache = split_kv_cache(kv_cache, DIM)
    assert key_cache.shape == value_cache.shape == (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    # A write through a split view lands in the cache tensor's first (keys) or second half.
    key_cache[3, 5, 1] = 1.0
    value_cache[3, 5, 1] = 2.0
    assert torch.all(kv_cache[3, 1, 5, :DIM] == 1) and torch.all(kv_cache[3, 1, 5, DIM:] == 2)

    _, _, gate = _gate()
    layer = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    gate_keys = layer.gate_keys(kv_cache)
    # One spare entry past the last page takes the masked-off lanes of fixed-size updates.
    assert gate_keys.num_pages == NUM_BLOCKS and gate_keys.fresh.shape == (NUM_BLOCKS + 1,)
    gate_keys.fresh[:] = True
    # The last page's slots (past what a count by KV heads would have sized).
    layer.mark_written(kv_cache, torch.tensor([(NUM_BLOCKS - 1) * BLOCK + 3, -1, 2 * BLOCK]))
    assert (~gate_keys.fresh[:NUM_BLOCKS]).nonzero().flatten().tolist() == [2, NUM_BLOCKS - 1]
    assert layer.gate_keys(kv_cache) is gate_keys
    [bigger] = vllm_kv_caches(1, layout, num_blocks=NUM_BLOCKS + 8)
    assert layer.gate_keys(bigger).num_pages == NUM_BLOCKS + 8  # a new cache starts afresh


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_are_compressed_again_only_after_writes(layout, monkeypatch):
    """Prefill, then decode token by token in vLLM's order (the new token's cache write, then
    attention): each step equals the contiguous path, and only pages written since their last
    compression are compressed again: every full page on the first step, later only a page
    that the step's token has just filled. Every step pools the same number of pages (a fixed
    shape), whatever the data."""
    model_config, _, gate = _gate()
    prompt, steps = [2 * BLOCK + 4, BLOCK + 1], BLOCK - 2
    requests = Requests(model_config, [n + steps for n in prompt], seed=3)
    [kv_cache] = vllm_kv_caches(1, layout)
    layer = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    pooled, per_step = [], set()
    pool = gate.pool
    monkeypatch.setattr(gate, "pool", lambda k, *a: pooled.append(k.shape[0]) or pool(k, *a))

    requests.write(kv_cache, layer, upto=prompt)
    for step in range(steps):
        lens = [n + step + 1 for n in prompt]
        for row, n in enumerate(lens):
            slots = requests.slots(row, n - 1, n)
            token = slice(n - 1, n)
            write_kv(kv_cache, requests.k_post[row, :, token].transpose(0, 1),
                     requests.v[row, :, token].transpose(0, 1), slots)  # fmt: skip
            layer.mark_written(kv_cache, slots)
        now = requests.at(model_config, lens)
        full_pages = [int(requests.block_table[r, j]) for r, n in enumerate(lens)
                      for j in range(n // BLOCK)]  # fmt: skip
        fresh = layer.gate_keys(kv_cache).fresh
        stale = [page for page in full_pages if not fresh[page]]
        pooled.clear()
        out = layer.decode(now.q_post, kv_cache, now.block_table, now.seq_lens, DIM**-0.5)
        per_step.add(tuple(pooled))
        expected_stale = (
            sum(n // BLOCK for n in lens) if step == 0 else sum(n % BLOCK == 0 for n in lens)
        )
        assert len(stale) == expected_stale, (step, lens)
        assert all(fresh[page] for page in full_pages)
        torch.testing.assert_close(
            out, now.expected(gate, {"token_budget": BLOCK}), atol=2e-5, rtol=2e-5
        )
    assert len(per_step) == 1, per_step


def test_compression_is_bounded_per_step_and_catches_up():
    """With more stale pages than a step may compress, each step compresses `refresh_pages` of
    them, the earliest rows' earliest pages first, and the keys end equal to compressing all."""
    model_config, config, gate = _gate()
    requests = Requests(model_config, [5 * BLOCK + 2, 3 * BLOCK])
    [kv_cache] = vllm_kv_caches(1, "LBNHC")
    requests.write(kv_cache)
    key_cache, value_cache = split_kv_cache(kv_cache, DIM)
    gate_keys, rotary = PagedGateKeys(gate, NUM_BLOCKS, "cpu"), HeadRotary(config)
    table = requests.block_table
    order = [int(table[0, j]) for j in range(5)] + [int(table[1, j]) for j in range(3)]
    for step in range(3):
        paged_sparse_decode(
            gate, gate_keys, rotary, requests.q_post, key_cache, value_cache, table,
            requests.seq_lens, token_budget=BLOCK, backend="torch", refresh_pages=3,
        )  # fmt: skip
        done = [page for page in order if gate_keys.fresh[page]]
        assert done == order[: 3 * (step + 1)]
    layer = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    requests.write(kv_cache, layer)
    layer.decode(requests.q_post, kv_cache, table, requests.seq_lens, DIM**-0.5)
    all_at_once = layer.gate_keys(kv_cache).keys
    torch.testing.assert_close(gate_keys.keys[order], all_at_once[order])


def test_shared_prefix_pages_are_compressed_once():
    model_config, _, gate = _gate()
    requests = Requests(model_config, [3 * BLOCK + 1, 3 * BLOCK + 1])
    requests.k_pre[1], requests.k_post[1], requests.v[1] = (
        requests.k_pre[0],
        requests.k_post[0],
        requests.v[0],
    )
    requests.block_table[1, :3] = requests.block_table[0, :3]  # vLLM's prefix cache shares them
    [kv_cache] = vllm_kv_caches(1, "LBNHC")
    layer = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    requests.write(kv_cache, layer)
    layer.decode(requests.q_post, kv_cache, requests.block_table, requests.seq_lens, DIM**-0.5)
    assert int(layer.gate_keys(kv_cache).fresh[:NUM_BLOCKS].sum()) == 3


def test_gather_puts_the_partial_block_first_and_masks_its_head():
    key_cache = (
        torch.arange(4 * BLOCK, dtype=torch.float)
        .view(4, BLOCK, 1, 1)
        .expand(4, BLOCK, KV_HEADS, 1)
    )
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([2 * BLOCK + 3], dtype=torch.int32)
    indices = torch.tensor([[[2, 0, -1], [2, 1, -1]]], dtype=torch.int32)
    k, _, slots, seqlens, starts = gather_selected(key_cache, key_cache, table, seq_lens, indices)
    assert starts.tolist() == [BLOCK - 3] and seqlens.tolist() == [3 * BLOCK]
    assert slots.tolist() == [[[0, 1, -1], [0, 1, -1]]]
    # slot 0 ends with the current block's 3 tokens (page 3, offsets 0..2)
    assert k[0, 0, BLOCK - 3 : BLOCK, 0].tolist() == [3 * BLOCK + t for t in range(3)]
    assert k[0, 0, BLOCK : 2 * BLOCK, 0].tolist() == [2 * BLOCK + t for t in range(BLOCK)]
    assert k[0, 1, BLOCK : 2 * BLOCK, 0].tolist() == [0 * BLOCK + t for t in range(BLOCK)]


def test_cache_geometry_is_checked():
    _, config, gate = _gate()
    layer = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    with pytest.raises(ValueError, match="block_size=16"):
        layer.gate_keys(torch.zeros(2, KV_HEADS, 2 * BLOCK, 2 * DIM))
    with pytest.raises(ValueError, match="holds 1 KV heads; the gates are for 2"):
        layer.gate_keys(torch.zeros(2, 1, BLOCK, 2 * DIM))
    with pytest.raises(ValueError, match="2 \\* head_size=32"):
        split_kv_cache(torch.zeros(2, KV_HEADS, BLOCK, DIM), DIM)
    with pytest.raises(ValueError, match="block_size=16"):  # the plain paged path checks too
        cache = torch.zeros(2, 2 * BLOCK, KV_HEADS, DIM)
        paged_sparse_decode(
            gate, PagedGateKeys(gate, 2, "cpu"), HeadRotary(config), torch.zeros(1, HEADS, DIM),
            cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]),
            token_budget=BLOCK, backend="torch",
        )  # fmt: skip


def test_tensor_parallel_workers_and_fp8_caches():
    _, config, _ = _gate()
    check_layer_heads(config, HEADS, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="tensor parallelism 2 .*tensor_parallel_size=1"):
        check_layer_heads(config, HEADS // 2, KV_HEADS // 2, DIM)
    with pytest.raises(ValueError, match="trained for another model"):
        check_layer_heads(config, HEADS, KV_HEADS, 2 * DIM)
    assert sparse_kv_cache_dtype("auto") and sparse_kv_cache_dtype("bfloat16")
    assert not sparse_kv_cache_dtype("fp8") and not sparse_kv_cache_dtype("fp8_e4m3")


def test_worker_settings_from_the_environment(tmp_path):
    path, selection = settings_from_env({GATE_ENV: str(tmp_path)})
    assert (path, selection) == (str(tmp_path), Selection(4096, None, "triton"))
    _, selection = settings_from_env({GATE_ENV: "g", THRESHOLD_ENV: "0.01"})
    assert selection == Selection(None, 0.01, "triton")
    with pytest.raises(RuntimeError, match=GATE_ENV):
        settings_from_env({})
    with pytest.raises(ValueError, match="not both"):
        settings_from_env({GATE_ENV: "g", THRESHOLD_ENV: "0.1", BUDGET_ENV: "64"})
    with pytest.raises(ValueError, match=f"{THRESHOLD_ENV}='1.5'"):
        settings_from_env({GATE_ENV: "g", THRESHOLD_ENV: "1.5"})


def _decode_step(model_config, gate, lens, seed):
    """A layer whose cache holds `lens` tokens of random requests, after one warm-up step (the
    first compresses the prompts' pages), and the next step's inputs: one new token per row."""
    requests = Requests(model_config, [n + 1 for n in lens], seed=seed)
    [kv_cache] = vllm_kv_caches(1, "LBNHC")
    layer = SeerLayer(gate, Selection(2 * BLOCK, None, "torch"))
    requests.write(kv_cache, layer, upto=lens)
    before = requests.at(model_config, lens)
    layer.decode(before.q_post, kv_cache, before.block_table, before.seq_lens, DIM**-0.5)
    rows = range(len(lens))
    slots = torch.cat([requests.slots(row, n, n + 1) for row, n in zip(rows, lens, strict=True)])
    token = torch.stack([requests.k_post[row, :, n] for row, n in zip(rows, lens, strict=True)])
    value = torch.stack([requests.v[row, :, n] for row, n in zip(rows, lens, strict=True)])
    return requests, kv_cache, layer, (token, value, slots)


def _run_step(requests, kv_cache, layer, new):
    """vLLM's order: the cache write of the new tokens, then attention."""
    token, value, slots = new
    write_kv(kv_cache, token, value, slots)
    layer.mark_written(kv_cache, slots)
    return layer.decode(
        requests.q_post, kv_cache, requests.block_table, requests.seq_lens, DIM**-0.5
    )


def test_a_decode_step_never_waits_on_the_host():
    """After warm-up, a decode step (cache-write bookkeeping, compression, scoring, selection,
    gather, attention) makes none of the calls that read a GPU tensor on the host or size a
    tensor by its data, even when a page fills up in the step."""
    model_config, _, gate = _gate()
    requests, kv_cache, layer, new = _decode_step(model_config, gate, [3 * BLOCK - 1, 9], seed=1)
    token, value, slots = new
    write_kv(kv_cache, token, value, slots)  # vLLM's cache write (a kernel there)
    with count_host_syncs() as syncs:
        layer.mark_written(kv_cache, slots)
        layer.decode(requests.q_post, kv_cache, requests.block_table, requests.seq_lens, 0.25)
    assert syncs == {}
    with count_host_syncs() as syncs:  # the counter sees what the old bookkeeping did
        torch.unique(slots[slots >= 0])
    assert syncs == {"boolean __getitem__": 1, "unique": 1}


def _step_profile(lens, seed):
    model_config, _, gate = _gate()
    requests, kv_cache, layer, new = _decode_step(model_config, gate, lens, seed)
    keys = layer.gate_keys(kv_cache)
    buffers = [t.data_ptr() for t in (keys.keys, keys.fresh, layer.rotary.inv_freq)]
    with torch.profiler.profile(profile_memory=True, record_shapes=True) as prof:
        _run_step(requests, kv_cache, layer, new)
    assert buffers == [t.data_ptr() for t in (keys.keys, keys.fresh, layer.rotary.inv_freq)]
    return [(e.name, str(e.input_shapes), e.cpu_memory_usage) for e in prof.events()]


def test_a_decode_step_runs_the_same_ops_and_allocations_whatever_the_data():
    """Two decode steps of the same batch size and table width, different lengths, scores and
    pages (one fills a page, one does not): the same ops on the same shapes, allocating the same
    bytes, and the layer's own buffers stay where they were: a caching allocator (or a CUDA
    graph's pool) serves every later step from what the first one took."""
    first = _step_profile([5 * BLOCK + 3, 2 * BLOCK + 1, 9], seed=4)
    second = _step_profile([6 * BLOCK - 1, BLOCK - 1, 4 * BLOCK + 2], seed=5)
    assert first == second
    assert any(bytes_ > 0 for _, _, bytes_ in first)


def test_decode_rows_of_a_mixed_step_match_a_pure_decode_step():
    """A step that holds prefill chunks after its decode rows (vLLM's order, with the sparse
    builder's reordering): the decode rows get exactly what they get decoding alone, and the
    prefill rows' full pages are compressed in the same step."""
    model_config, _, gate = _gate()
    decode_lens, prefill_lens = [4 * BLOCK + 3, 2 * BLOCK], [3 * BLOCK + 5]
    requests = Requests(model_config, decode_lens + prefill_lens, seed=6)
    [mixed_cache] = vllm_kv_caches(1, "LBNHC")
    mixed = SeerLayer(gate, Selection(BLOCK, None, "torch"))
    requests.write(mixed_cache, mixed, upto=[*decode_lens, 0])
    mixed.decode(requests.q_post[:2], mixed_cache, requests.block_table[:2],
                 requests.seq_lens[:2], DIM**-0.5)  # fmt: skip
    [alone_cache] = vllm_kv_caches(1, "LBNHC")
    alone_cache.copy_(mixed_cache)
    alone = copy.deepcopy(mixed)

    chunk = requests.slots(2, 0, prefill_lens[0])  # the prefill row's chunk, written this step
    write_kv(mixed_cache, requests.k_post[2].transpose(0, 1), requests.v[2].transpose(0, 1),
             chunk)  # fmt: skip
    mixed.mark_written(mixed_cache, chunk)
    # The step's tokens: the decode rows' new tokens first, then the prefill chunk's.
    query = torch.cat([requests.q_post[:2], torch.randn(prefill_lens[0], HEADS, DIM)])
    num_tokens = 2 + prefill_lens[0]
    out = mixed.decode(query, mixed_cache, requests.block_table, requests.seq_lens, DIM**-0.5,
                       num_decodes=2, num_tokens=num_tokens)  # fmt: skip
    pure = alone.decode(requests.q_post[:2], alone_cache, requests.block_table[:2],
                        requests.seq_lens[:2], DIM**-0.5)  # fmt: skip
    assert torch.equal(out, pure)
    expected = requests.at(model_config, decode_lens)
    for name in ("q_pre", "q_post", "k_pre", "k_post", "v", "block_table"):
        setattr(expected, name, getattr(requests, name)[:2])
    torch.testing.assert_close(
        out, expected.expected(gate, {"token_budget": BLOCK}), atol=2e-5, rtol=2e-5
    )
    prefill_pages = requests.block_table[2, : prefill_lens[0] // BLOCK].long()
    assert bool(mixed.gate_keys(mixed_cache).fresh[prefill_pages].all())


def test_the_memory_set_aside_is_what_the_gate_keys_take():
    """`plugin_memory`'s fraction of the KV cache is what the layer allocates for a cache of
    that size (its spare entry aside), in the cache's dtype."""
    _, config, gate = _gate()
    [kv_cache] = vllm_kv_caches(1, "LBNHC", dtype=torch.bfloat16)
    keys = SeerLayer(gate, Selection(BLOCK, None, "torch")).gate_keys(kv_cache)
    taken = sum(t[:NUM_BLOCKS].nbytes for t in (keys.keys, keys.fresh))
    memory = plugin_memory(config, Selection(BLOCK, None, "torch"), max_num_seqs=1)
    assert taken == pytest.approx(memory.gate_keys_fraction * kv_cache.nbytes, rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_step_is_captured_in_a_cuda_graph(dtype):
    """The step through the compiled Triton kernel, captured in a CUDA graph (capture fails on
    any host sync, those inside C++ ops included) and replayed: equal to the eager step, which
    is close to the PyTorch path."""
    model_config, _, gate = _gate()
    requests = Requests(model_config, [7 * BLOCK + 5, 4 * BLOCK, 1])
    [kv_cache] = vllm_kv_caches(1, "LBNHC", dtype=dtype)
    requests.write(kv_cache)
    kv_cache, gate = kv_cache.cuda(), gate.cuda()
    args = (requests.q_post.to("cuda", dtype), kv_cache, requests.block_table.cuda(),
            requests.seq_lens.cuda(), DIM**-0.5)  # fmt: skip
    torch_path = SeerLayer(gate, Selection(2 * BLOCK, None, "torch")).decode(*args)
    layer = SeerLayer(gate, Selection(2 * BLOCK, None, "triton"))
    eager = layer.decode(*args)  # compiles the kernel, compresses the pages
    torch.testing.assert_close(eager, torch_path, atol=2e-2, rtol=2e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.decode(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.decode(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
