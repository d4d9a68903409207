"""vLLM 0.32.0's KV cache as its FlashAttention backend lays it out, handled without vLLM.

Everything the SeerAttention-R backend (`vllm_backend.py`, a thin shell over this module) does to
vLLM's tensors happens here, so it is tested on CPU tensors laid out exactly as vLLM lays them out
(tests/kernels/test_vllm_layout.py). What vLLM 0.32.0 does, with the places in its wheel:

- One layer's cache is the logical 4-D view `[num_blocks, num_kv_heads, block_size,
  2 * head_size]` (`vllm/v1/attention/backends/flash_attn.py`, `FlashAttentionImpl.forward`'s
  docstring, lines 1196-1197). vLLM allocates one flat buffer and makes each layer's view with
  `torch.as_strided` (`vllm/v1/kv_cache_interface.py`, `create_kv_cache_views`, lines 377-441,
  strides from `compute_layout_strides`, lines 338-374); which axis is outermost in memory is
  the layout's stride order (`vllm/v1/kv_cache_layout.py`, lines 23-28), by default LBNHC, i.e.
  each block stored `[block_size, num_kv_heads, C]` (`vllm/v1/attention/backends/utils.py`,
  `_DEFAULT_LAYOUT_PREFERENCE`, line 195). Only indexing is used here, never `.view`, so any of
  those stride orders works.
- Keys and values are the two halves of the last axis, split by
  `kv_cache.transpose(1, 2).split(head_size, dim=-1)` into two `[num_blocks, block_size,
  num_kv_heads, head_size]` views (flash_attn.py lines 1251-1252 in `forward`, 1442-1443 in
  `do_kv_cache_update`): `split_kv_cache`. The page count is `kv_cache.shape[0]`.
- A token's slot is `block_number * block_size + offset` (`vllm/v1/worker/block_table.py`,
  line 374), slot_mapping is int64 (line 86) and -1 marks padding (PAD_SLOT_ID; the cache write
  skips it: `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`, lines 62-67).
- The decode metadata (`FlashAttentionMetadata`, flash_attn.py lines 522-528): `max_query_len`
  (1 in a batch of pure decode steps), `num_actual_tokens`, `seq_lens [num_reqs]` (context plus
  the new token), `block_table [num_reqs, max_blocks]` int32 (block_table.py line 81).
- An fp8 cache holds bytes that the backend reinterprets (flash_attn.py lines 1271-1274) and
  scales inside the kernel; the gates score unscaled keys, so fp8 caches stay dense
  (`sparse_kv_cache_dtype`).
- With tensor parallelism each worker holds `num_kv_heads / tp` heads of the layer; the gates
  are trained on all heads, so a worker whose heads differ from the gates' is refused
  (`check_layer_heads`) rather than scored with the wrong heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gate import AttnGate, GateConfig
from .paged import (
    CATCH_UP_PAGES,
    HeadRotary,
    PagedGateKeys,
    paged_sparse_decode,
    refresh_limit,
)
from .selection import check_selection

# vLLM's kv_cache_dtype strings whose cache holds the model's own fp16/bf16 values.
SPARSE_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's key and value views `[num_blocks, block_size, num_kv_heads, head_size]` of one
    layer's cache `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, as its FlashAttention
    backend splits it."""
    if kv_cache.dim() != 4 or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"expected vLLM's FlashAttention KV cache [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size={2 * head_size}], got shape {tuple(kv_cache.shape)}"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def sparse_kv_cache_dtype(kv_cache_dtype: str) -> bool:
    """Whether a cache of vLLM's `kv_cache_dtype` can be read by the gates (fp8 ones cannot)."""
    return kv_cache_dtype in SPARSE_KV_CACHE_DTYPES


def check_layer_heads(config: GateConfig, num_heads: int, num_kv_heads: int, head_size: int):
    """Raise ValueError unless one worker's attention layer has the heads the gates were
    trained for (it does not under tensor parallelism above 1)."""
    expected = (config.num_heads, config.num_kv_heads, config.head_dim)
    if (num_heads, num_kv_heads, head_size) == expected:
        return
    tp = config.num_kv_heads / num_kv_heads if num_kv_heads else float("nan")
    raise ValueError(
        f"this vLLM worker's attention layer has {num_heads} query and {num_kv_heads} KV heads "
        f"of dim {head_size}; the SeerAttention-R gates are for {config.num_heads} and "
        f"{config.num_kv_heads} of dim {config.head_dim}"
        + (
            f" (tensor parallelism {tp:g} splits the heads across workers; the sparse backend "
            "supports tensor_parallel_size=1 only)"
            if head_size == config.head_dim and tp != 1
            else " (were the gates trained for another model?)"
        )
    )


@dataclass(frozen=True)
class Selection:
    """How a decode step picks blocks: a token budget or a threshold, and the kernel."""

    token_budget: int | None
    threshold: float | None
    kernel: str = "triton"

    def __post_init__(self) -> None:
        check_selection(self.token_budget, self.threshold)


class SeerLayer:
    """SeerAttention-R decode state of one attention layer over vLLM's cache: the layer's gate,
    the RoPE it undoes, and the gate keys of its pages (built on the first cache it sees)."""

    def __init__(self, gate: AttnGate, selection: Selection):
        self.gate = gate
        self.selection = selection
        self.rotary = HeadRotary(gate.config)
        self._keys: PagedGateKeys | None = None

    def gate_keys(self, kv_cache: torch.Tensor) -> PagedGateKeys:
        """The page bookkeeping for this cache: one entry per block (`kv_cache.shape[0]`); a
        cache of another size or device (vLLM re-allocated it) starts afresh."""
        c = self.gate.config
        _, heads, block_size, _ = kv_cache.shape
        if heads != c.num_kv_heads:
            raise ValueError(
                f"the KV cache holds {heads} KV heads; the gates are for {c.num_kv_heads}"
            )
        if block_size != c.block_size:
            raise ValueError(
                f"the KV cache's block size is {block_size}; SeerAttention-R needs it equal to "
                f"the gates' block size {c.block_size} (run vLLM with block_size={c.block_size})"
            )
        keys = self._keys
        if keys is None or keys.num_pages != kv_cache.shape[0] or keys.device != kv_cache.device:
            self._keys = keys = PagedGateKeys(self.gate, kv_cache.shape[0], kv_cache.device)
        return keys

    def mark_written(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After vLLM's cache write: the pages it wrote into are compressed again when next read."""
        if kv_cache.numel() == 0:  # the profiling run has no cache yet
            return
        self.gate_keys(kv_cache).mark_written(slot_mapping)

    def refresh(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_tokens: int,
    ) -> None:
        """Compress the pages that the step's `num_tokens` cache writes filled (every request's
        row of `block_table` and `seq_lens`), as many as they can fill whatever the data."""
        c = self.gate.config
        key_cache, _ = split_kv_cache(kv_cache, c.head_dim)
        num_reqs = seq_lens.shape[0]
        limit = refresh_limit(num_tokens, num_reqs, c.block_size, CATCH_UP_PAGES)
        rows = block_table[:num_reqs]
        self.gate_keys(kv_cache).refresh(key_cache, rows, seq_lens, self.rotary, limit)

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        num_decodes: int | None = None,
        num_tokens: int | None = None,
    ) -> torch.Tensor:
        """Attention of the step's decode rows over the blocks the gate selects.

        The step's requests are vLLM's, decodes first (the backend's builder reorders them so):
        rows `:num_decodes` (default: all) each have one new token, `query[:num_decodes]`
        (`[n, H_q, D]`, post-RoPE, its key already in the cache); the other rows are prefill
        chunks, attended densely by the caller. The pages every row's writes filled (at most
        what `num_tokens` tokens can fill, default one per row) are compressed first, so a
        request's first decode step finds its prompt's pages compressed. Returns `[n, H_q, D]`,
        which depends on the decode rows alone, not on what they are batched with."""
        c = self.gate.config
        key_cache, value_cache = split_kv_cache(kv_cache, c.head_dim)
        num_reqs = seq_lens.shape[0]
        n = num_reqs if num_decodes is None else num_decodes
        self.refresh(kv_cache, block_table, seq_lens, num_tokens or num_reqs)
        return paged_sparse_decode(
            self.gate,
            self.gate_keys(kv_cache),
            self.rotary,
            query[:n],
            key_cache,
            value_cache,
            block_table[:n],
            seq_lens[:n],
            token_budget=self.selection.token_budget,
            threshold=self.selection.threshold,
            backend=self.selection.kernel,
            scale=scale,
            refresh_pages=0,
        )


@dataclass(frozen=True)
class PluginMemory:
    """What the sparse backend allocates beyond what vLLM's memory profile sees (vLLM profiles
    with attention skipped: `vllm/v1/worker/gpu/model_runner.py`). The gates are loaded while
    vLLM builds the model, so the profile counts them."""

    gate_keys_fraction: float  # the gate keys and page flags, as a fraction of the KV cache
    scratch_bytes: int | None  # one layer's decode step at max_num_seqs (None: grows with context)

    def utilization(self, gpu_memory_utilization: float, gpu_memory_bytes: int | None) -> float:
        """The gpu_memory_utilization to give vLLM so that its KV cache, with the gate keys
        sized by it and the scratch, fits in what `gpu_memory_utilization` allows: dividing by
        1 + fraction keeps cache + keys within the cache's share of the original budget."""
        share = gpu_memory_utilization / (1 + self.gate_keys_fraction)
        if gpu_memory_bytes and self.scratch_bytes:
            share -= self.scratch_bytes / gpu_memory_bytes
        if share <= 0:
            raise ValueError(
                f"gpu_memory_utilization {gpu_memory_utilization} leaves no room for the sparse "
                f"backend's scratch ({self.scratch_bytes} bytes): lower --max-num-seqs"
            )
        return share


def plugin_memory(
    config: GateConfig, selection: Selection, max_num_seqs: int, cache_itemsize: int = 2
) -> PluginMemory:
    """The sparse backend's memory for gates of `config` over a cache of `cache_itemsize` bytes
    per value: per page and layer, fp32 gate keys `[H_kv, gate_dim]` and one flag byte against
    the page's keys and values `[block, H_kv, 2·D]`; per decode step, the gathered keys and
    values of the selected pages and the fp32 tokens of the pages compressed
    (`paged.refresh_limit`). A threshold selects up to the whole block table, so its scratch
    grows with the context and is left to the caller."""
    b, heads, dim = config.block_size, config.num_kv_heads, config.head_dim
    fraction = (heads * config.gate_dim * 4 + 1) / (b * heads * 2 * dim * cache_itemsize)
    if selection.token_budget is None:
        return PluginMemory(fraction, None)
    selected = (selection.token_budget // b + 2) * b
    gathered = 2 * max_num_seqs * heads * selected * dim * cache_itemsize
    pages = refresh_limit(max_num_seqs, max_num_seqs, b, CATCH_UP_PAGES)
    compressed = pages * b * heads * dim * 4 * 3  # the keys unrotated, and pooling's two copies
    return PluginMemory(fraction, gathered + compressed)
