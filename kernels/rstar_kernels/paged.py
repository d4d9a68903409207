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
        freqs = positions[..., None].float() * self.inv_freq.to(x.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = x.float()
        # The forward map is x·s·cos + rotate_half(x)·s·sin, a rotation scaled by s.
        return (x * cos - rotate_half(x) * sin) / self.scale


class PagedGateKeys:
    """Gate keys of one layer's full pages, by physical page id."""

    def __init__(self, gate: AttnGate, num_pages: int, device: torch.device | str):
        c = gate.config
        self.gate = gate
        self.page_size = c.block_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.keys = torch.zeros(num_pages, c.num_kv_heads, c.gate_dim, device=device)
        self.fresh = torch.zeros(num_pages, dtype=torch.bool, device=device)

    def mark_written(self, slot_mapping: torch.Tensor) -> None:
        """Forget the pages that vLLM's cache update writes into (slot = page·b + offset)."""
        slots = slot_mapping[slot_mapping >= 0].long()  # -1: padding tokens, not written
        self.fresh[slots // self.page_size] = False

    def refresh(
        self,
        key_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        rotary: HeadRotary,
    ) -> None:
        """Compress every full page of the batch that is not fresh."""
        b = self.page_size
        full = seq_lens.long() // b  # [B]
        logical = torch.arange(block_table.shape[1], device=block_table.device)
        in_use = logical[None, :] < full[:, None]
        pages = block_table.long()[in_use]
        blocks = logical.expand_as(block_table)[in_use]
        stale = ~self.fresh[pages]
        pages, blocks = pages[stale], blocks[stale]
        if pages.numel() == 0:
            return
        # A page shared by several requests sits at the same logical index in each of them.
        pages, first = _unique_with_first(pages)
        blocks = blocks[first]
        positions = blocks[:, None] * b + torch.arange(b, device=pages.device)  # [n, b]
        k = rotary.unrotate(key_cache[pages], positions[:, :, None])  # [n, b, H_kv, D]
        pooled = self.gate.pool(k.transpose(1, 2))  # [n, H_kv, 1, 3D]
        gk = self.gate.keys(pooled, (blocks * b)[:, None])  # [n, H_kv, 1, d]
        self.keys[pages] = gk[:, :, 0].to(self.keys.dtype)
        self.fresh[pages] = True


def _unique_with_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values and the index of each one's first occurrence."""
    unique, inverse = torch.unique(values, return_inverse=True)
    order = torch.arange(values.numel(), device=values.device)
    first = torch.full_like(unique, values.numel()).scatter_reduce(0, inverse, order, "amin")
    return unique, first


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
) -> torch.Tensor:
    """One decode token per request: post-RoPE `query [B, H_q, D]` (its key already in the
    cache), `seq_lens [B]` including it. Returns the attention output `[B, H_q, D]`."""
    b = gate.config.block_size
    if key_cache.shape[1] != b:
        raise ValueError(
            f"the KV cache's page size is {key_cache.shape[1]}; SeerAttention-R needs it equal "
            f"to the gate's block size {b} (run vLLM with block_size={b})"
        )
    gate_keys.refresh(key_cache, block_table, seq_lens, rotary)
    position = seq_lens.long() - 1
    q_pre = rotary.unrotate(query, position[:, None]).to(query.dtype)
    gq = gate.query(q_pre[:, :, None], position[:, None])  # [B, H_kv, 1, d]
    full = seq_lens.long() // b
    width = max(int(full.max()), 1)
    pages = block_table[:, :width].long()
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
