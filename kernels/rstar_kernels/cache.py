"""The gate's K-compression cache of one layer (docs/seer-attention.md).

It holds the gate keys of the complete blocks (pooled, projected by W_k, normalised and rotated,
`[B, H_kv, N, gate_dim]`) and the raw pre-RoPE keys of the current partial block. A block is
compressed once, when its last token arrives, so each decode step costs one block's pooling at
most; the partial block is never scored (selection forces it on).

Blocks are aligned to the padded cache: block j covers cache positions [j·b, (j+1)·b) of every
row. Padding tokens (`valid` false) are left out of the pooling, and a block is rotated to the
position id of its first valid token. The upstream code zero-fills a placeholder entry for the
partial block and, for blocks completed during decoding, rotates to the position of the token that
completes the block; here every block, prefilled or decoded, uses its first valid token's position
(the paper's and the training code's choice), so after N steps the cache equals compressing the
whole key sequence at once.
"""

from __future__ import annotations

import torch


class CompressedKeyCache:
    """Compressed gate keys of one layer for a batch of rows; `gate` is the layer's `AttnGate`."""

    def __init__(self, gate):
        self.gate = gate
        self.block_size = gate.config.block_size
        self.keys: torch.Tensor | None = None  # [B, H_kv, N, gate_dim]
        self.block_valid: torch.Tensor | None = None  # [B, N]: the block holds a valid token
        self._rest_k: torch.Tensor | None = None  # [B, H_kv, r, D], r < block_size
        self._rest_valid: torch.Tensor | None = None  # [B, r]
        self._rest_pos: torch.Tensor | None = None  # [B, r]

    @property
    def length(self) -> int:
        """Tokens seen so far (padding included): the length of the layer's KV cache."""
        if self.keys is None:
            return 0
        return self.keys.shape[2] * self.block_size + self._rest_k.shape[2]

    @property
    def num_complete(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def prefill(
        self,
        k_pre_rope: torch.Tensor,
        valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Start over from a prompt's pre-RoPE keys [B, H_kv, L, D].

        valid bool [B, L] (default all true) marks the non-padding tokens; positions [B, L] are
        their position ids (default 0..L-1).
        """
        if k_pre_rope.dim() != 4:
            raise ValueError(f"k_pre_rope must be [B, H_kv, L, D], got {tuple(k_pre_rope.shape)}")
        batch, _, length, _ = k_pre_rope.shape
        device = k_pre_rope.device
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool, device=device)
        if positions is None:
            positions = torch.arange(length, device=device).expand(batch, length)
        for name, t in (("valid", valid), ("positions", positions)):
            if tuple(t.shape) != (batch, length):
                raise ValueError(
                    f"{name} must be [B, L] = [{batch}, {length}], got {tuple(t.shape)}"
                )
        valid = valid.to(device=device, dtype=torch.bool)
        positions = positions.to(device=device, dtype=torch.long)
        complete = length // self.block_size * self.block_size
        self.keys, self.block_valid = self._compress(
            k_pre_rope[:, :, :complete], valid[:, :complete], positions[:, :complete]
        )
        self._rest_k = k_pre_rope[:, :, complete:].clone()
        self._rest_valid = valid[:, complete:].clone()
        self._rest_pos = positions[:, complete:].clone()

    def append(self, k_step: torch.Tensor, position: torch.Tensor) -> None:
        """Add one decode step's pre-RoPE key [B, H_kv, 1, D] at position ids [B]; compress the
        block it completes, if any."""
        if self.keys is None:
            raise RuntimeError("CompressedKeyCache.append before prefill")
        if k_step.dim() != 4 or k_step.shape[2] != 1 or k_step.shape[:2] != self._rest_k.shape[:2]:
            raise ValueError(
                f"k_step must be [B, H_kv, 1, D] = [{self._rest_k.shape[0]}, "
                f"{self._rest_k.shape[1]}, 1, D], got {tuple(k_step.shape)}"
            )
        position = position.reshape(-1).to(device=k_step.device, dtype=torch.long)
        self._rest_k = torch.cat([self._rest_k, k_step.to(self._rest_k.dtype)], dim=2)
        step_valid = self._rest_valid.new_ones(k_step.shape[0], 1)
        self._rest_valid = torch.cat([self._rest_valid, step_valid], dim=1)
        self._rest_pos = torch.cat([self._rest_pos, position[:, None]], dim=1)
        if self._rest_k.shape[2] < self.block_size:
            return
        keys, block_valid = self._compress(self._rest_k, self._rest_valid, self._rest_pos)
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.block_valid = torch.cat([self.block_valid, block_valid], dim=1)
        self._rest_k = self._rest_k[:, :, :0]
        self._rest_valid = self._rest_valid[:, :0]
        self._rest_pos = self._rest_pos[:, :0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place (row i becomes rows i·r .. i·r + r - 1), as
        transformers' `Cache.batch_repeat_interleave` does for n samples of one prompt."""
        if self.keys is None:
            raise RuntimeError("CompressedKeyCache.batch_repeat_interleave before prefill")
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.block_valid = self.block_valid.repeat_interleave(repeats, dim=0)
        self._rest_k = self._rest_k.repeat_interleave(repeats, dim=0)
        self._rest_valid = self._rest_valid.repeat_interleave(repeats, dim=0)
        self._rest_pos = self._rest_pos.repeat_interleave(repeats, dim=0)

    def _compress(self, k, valid, positions):
        """Gate keys and validity of the complete blocks of k [B, H_kv, n·b, D]."""
        batch, heads, length, _ = k.shape
        blocks = length // self.block_size
        if blocks == 0:
            # A prompt shorter than one block: nothing to compress yet.
            keys = k.new_zeros(
                batch, heads, 0, self.gate.config.gate_dim, dtype=self.gate.k_weight.dtype
            )
            return keys, torch.zeros(batch, 0, dtype=torch.bool, device=k.device)
        by_block = valid.reshape(batch, blocks, self.block_size)
        block_valid = by_block.any(dim=-1)
        # Position of each block's first valid token (a block with none gets 0; it is masked).
        first = by_block.to(torch.int8).argmax(dim=-1)
        block_pos = positions.reshape(batch, blocks, self.block_size).gather(-1, first[..., None])
        block_pos = torch.where(block_valid, block_pos[..., 0], 0)
        pooled = self.gate.pool(k, valid)
        return self.gate.keys(pooled, block_pos), block_valid
