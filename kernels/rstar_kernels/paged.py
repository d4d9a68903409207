"""SeerAttention-R decode steps over a paged KV cache, in plain PyTorch.

The keys and values are vLLM's views `key_cache, value_cache [num_pages, page_size, H_kv, D]`
(post-RoPE; how they come out of vLLM's cache tensor: `vllm_layout.split_kv_cache`), addressed
through a per-request `block_table [B, max_pages]`. With `page_size` equal to the gate's block
size, one page is one gate block, so:
- the gate keys of full pages are kept per physical page id (`PagedGateKeys`); a page is
  compressed once, when a step finds it full and not yet compressed, and again only after vLLM
  writes into it (`mark_written` from the cache update, so a freed and reused page is never read
  stale); requests that share a prefix share its pages' gate keys;
- the gate needs pre-RoPE keys and queries, vLLM caches post-RoPE ones: the rotation is undone
  (`unrotate`, exact up to the cache dtype's rounding), as docs/seer-attention.md describes;
- the selected pages are gathered into a contiguous `[B, H_kv, S·b, D]` buffer and handed to
  `sparse_decode`. The current, partial page goes first (selection sorts it first) with its tokens
  moved to the end of its slot, so `starts` masks the slot's unfilled head. The gather copies the
  selected tokens once more than a paged kernel would (S·b tokens per KV head, not the context).

Requests have no left padding here (vLLM packs them), so every row starts at position 0.
"""

from __future__ import annotations

import dataclasses

import torch

from .decode import sparse_decode
from .gate import AttnGate, GateConfig, _gate_inv_freq, rotate_half
from .selection import select_blocks

# Pages each step compresses beyond what its own writes can fill. Every write is seen by the
# layer (prefill-only steps compress too), so a backlog is rare; each page here costs every step.
CATCH_UP_PAGES = 8


class HeadRotary:
    """The base model's RoPE over the full head dim (rotate_half form, as Llama/Qwen), read from
    the gate config, which records the model's theta and scaling."""

    def __init__(self, config: GateConfig):
        self.inv_freq, self.scale = _gate_inv_freq(
            dataclasses.replace(config, gate_dim=config.head_dim)
        )

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE values of post-RoPE `x [..., D]` at `positions` (broadcast to x[..., 0]);
        computed in fp32."""
        if self.inv_freq.device != x.device:
            # Moved once: a copy from host memory in every step would wait on the stream.
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = x.float()
        # The forward map is x·s·cos + rotate_half(x)·s·sin, a rotation scaled by s.
        return (x * cos - rotate_half(x) * sin) / self.scale


class PagedGateKeys:
    """Gate keys of one layer's full pages, by physical page id.

    Both tables have one spare entry past the last page, where the masked-off lanes of the
    fixed-size updates land, so no update needs a data-dependent size or a read on the host.
    """

    def __init__(self, gate: AttnGate, num_pages: int, device: torch.device | str):
        c = gate.config
        self.gate = gate
        self.page_size = c.block_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.keys = torch.zeros(num_pages + 1, c.num_kv_heads, c.gate_dim, device=device)
        self.fresh = torch.zeros(num_pages + 1, dtype=torch.bool, device=device)

    def mark_written(self, slot_mapping: torch.Tensor) -> None:
        """Forget the pages that vLLM's cache update writes into (slot = page·b + offset)."""
        slots = slot_mapping.long()
        # -1 marks padding tokens, which vLLM does not write: they go to the spare entry.
        pages = torch.where(slots >= 0, slots // self.page_size, self.num_pages)
        self.fresh.index_fill_(0, pages, False)

    @torch.no_grad()
    def refresh(
        self,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        rotary: HeadRotary,
        limit: int,
    ) -> None:
        """Compress up to `limit` full pages of the batch that are not fresh, the earliest rows'
        earliest pages first. Exactly `limit` pages are pooled whatever the data (the lanes
        without a stale page pool page 0 into the spare entry). A stale page left over keeps
        the keys it holds until a later step compresses it."""
        b = self.page_size
        width = block_table.shape[1]
        pages = block_table.long().reshape(-1)
        logical = torch.arange(width, device=pages.device)
        in_use = (logical[None, :] < (seq_lens.long() // b)[:, None]).reshape(-1)
        stale = in_use & ~self.fresh[pages]
        # Distinct priorities (exact in fp32 below 2**24 entries): earlier entries rank higher.
        rank = torch.arange(pages.numel(), 0, -1, device=pages.device, dtype=torch.float32)
        top, picked = torch.where(stale, rank, 0.0).topk(min(limit, pages.numel()))
        chosen = top > 0
        source = torch.where(chosen, pages[picked], 0)
        target = torch.where(chosen, source, self.num_pages)
        blocks = picked % width
        positions = blocks[:, None] * b + torch.arange(b, device=pages.device)  # [n, b]
        k = rotary.unrotate(key_cache[source], positions[:, :, None])  # [n, b, H_kv, D]
        pooled = self.gate.pool(k.transpose(1, 2))  # [n, H_kv, 1, 3D]
        gk = self.gate.keys(pooled, (blocks * b)[:, None])  # [n, H_kv, 1, d]
        # A page shared by several requests sits at the same logical index in each of them, so
        # duplicate targets receive identical keys.
        self.keys.index_copy_(0, target, gk[:, :, 0].to(self.keys.dtype))
        self.fresh.index_fill_(0, target, True)


def refresh_limit(num_tokens: int, num_reqs: int, page_size: int, catch_up: int) -> int:
    """How many pages a step compresses: every page its `num_tokens` cache writes can fill (a
    request's run of n tokens completes at most n // b + 1 pages), plus `catch_up` left over
    from earlier steps (a cache written before the layer saw it)."""
    return num_tokens // page_size + num_reqs + catch_up


def gather_selected(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selected pages as contiguous `sparse_decode` inputs.

    `indices int32 [B, H_kv, S]` are logical blocks sorted descending (the current block first),
    -1 padded. Returns k, v `[B, H_kv, S·b, D]`, slot indices `[B, H_kv, S]` (s, or -1),
    seqlens `[B]` = S·b and starts `[B]` = the unfilled head of slot 0.
    """
    _, b, heads, _ = key_cache.shape
    batch, _, width = indices.shape
    picked = indices.long()
    page = block_table.long().gather(1, picked.clamp(min=0).view(batch, -1)).view_as(picked)
    filled = seq_lens.long() - (seq_lens.long() - 1) // b * b  # tokens in the current block
    offset = torch.arange(b, device=key_cache.device)
    # Slot 0 holds the current block with its filled tokens moved to the slot's end.
    shift = torch.zeros(batch, width, 1, dtype=torch.long, device=key_cache.device)
    shift[:, 0, 0] = b - filled
    token = (offset[None, None, :] - shift).clamp(min=0)  # [B, S, b]
    head = torch.arange(heads, device=key_cache.device)[None, :, None, None]
    rows = (page[..., None], token[:, None], head)  # -> [B, H_kv, S, b]
    k = key_cache[rows].reshape(batch, heads, width * b, -1)
    v = value_cache[rows].reshape(batch, heads, width * b, -1)
    slots = torch.arange(width, device=indices.device, dtype=torch.int32).expand_as(indices)
    slots = torch.where(indices >= 0, slots, -1).contiguous()
    seqlens = torch.full((batch,), width * b, dtype=torch.int32, device=key_cache.device)
    return k, v, slots, seqlens, (b - filled).to(torch.int32)


@torch.no_grad()
def paged_sparse_decode(
    gate: AttnGate,
    gate_keys: PagedGateKeys,
    rotary: HeadRotary,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    token_budget: int | None = None,
    threshold: float | None = None,
    backend: str = "triton",
    scale: float | None = None,
    refresh_pages: int | None = None,
) -> torch.Tensor:
    """One decode token per request: post-RoPE `query [B, H_q, D]` (its key already in the
    cache), `seq_lens [B]` including it. Returns the attention output `[B, H_q, D]`.

    Every shape is fixed by B, the block table's width and the selection rule, never by the
    data: the blocks are scored over the whole table width (pages past a row's end masked), and
    `refresh_pages` pages are compressed (default: what B decode tokens can fill, plus
    CATCH_UP_PAGES; 0 when the caller has compressed them)."""
    b = gate.config.block_size
    if key_cache.shape[1] != b:
        raise ValueError(
            f"the KV cache's page size is {key_cache.shape[1]}; SeerAttention-R needs it equal "
            f"to the gate's block size {b} (run vLLM with block_size={b})"
        )
    if refresh_pages is None:
        batch = block_table.shape[0]
        refresh_pages = refresh_limit(batch, batch, b, CATCH_UP_PAGES)
    if refresh_pages:
        gate_keys.refresh(key_cache, block_table, seq_lens, rotary, refresh_pages)
    position = seq_lens.long() - 1
    q_pre = rotary.unrotate(query, position[:, None]).to(query.dtype)
    gq = gate.query(q_pre[:, :, None], position[:, None])  # [B, H_kv, 1, d]
    full = seq_lens.long() // b
    width = block_table.shape[1]
    pages = block_table.long()
    gk = gate_keys.keys[pages].permute(0, 2, 1, 3).to(gq.dtype)  # [B, H_kv, N, d]
    valid = torch.arange(width, device=pages.device)[None, :] < full[:, None]
    logits = gate.logits(gq, gk, valid)[:, :, 0]
    indices = select_blocks(
        logits,
        (seq_lens.long() + b - 1) // b,
        0,
        token_budget=token_budget,
        threshold=threshold,
        block_size=b,
    )
    k, v, slots, seqlens, starts = gather_selected(
        key_cache, value_cache, block_table, seq_lens, indices
    )
    return sparse_decode(query, k, v, slots, seqlens, b, backend, starts=starts, scale=scale)
