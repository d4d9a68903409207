"""Which KV blocks a decode step reads: the gate's scores turned into `block_indices`.

Per (row, KV head), over the blocks `first_block[b] <= j < num_blocks[b]`:
- always kept: the current block `num_blocks[b] - 1` (it holds the new token and is never scored
  as a candidate, as in training, where the query's own block is left out of the target) and the
  row's first valid block (the attention sink; upstream's HF decode path forces it in the kernel);
- budget mode: the `token_budget // block_size` highest-scoring other blocks, so a step reads at
  most the budget plus the two forced blocks;
- threshold mode: every candidate block whose softmax probability, over the candidates (every
  scored block before the current one, the first valid block included), exceeds `threshold`.

The result is int32 `[B, H_kv, S]`, sorted descending (the current block first), -1 padded, with
`S = token_budget // block_size + 2` (budget) or `N + 2` (threshold), so its width does not depend
on the scores.

Selection launches the same kernels whatever the scores and never reads a tensor on the host, so a
decode step on a GPU does not wait for it. Integer arguments are checked always; per-row tensor
arguments (whose check would read them back) only with RSTAR_SEER_DEBUG=1.
"""

from __future__ import annotations

import os

import torch

DEBUG_ENV = "RSTAR_SEER_DEBUG"


def debug_checks() -> bool:
    """Whether checks that read GPU tensors back on the host (and so stall the stream) run."""
    return os.environ.get(DEBUG_ENV) == "1"


def _per_row(value: int | torch.Tensor, batch: int, name: str, device) -> torch.Tensor:
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long, device=device)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must be an int or a [B] = [{batch}] tensor, got {value!r}")
    if value.dtype.is_floating_point:
        raise TypeError(f"{name} must hold integers, got {value.dtype}")
    return value.to(device=device, dtype=torch.long)


def _check_rows(total: torch.Tensor, first: torch.Tensor, scored: int) -> None:
    if bool((total < 1).any()) or bool((total > scored + 1).any()):
        raise ValueError(
            f"num_blocks must be in [1, N + 1] = [1, {scored + 1}] (logits score N complete "
            f"blocks), got {total.tolist()}"
        )
    if bool((first < 0).any()) or bool((first >= total).any()):
        raise ValueError(
            f"first_block must lie in [0, num_blocks), got {first.tolist()} for {total.tolist()}"
        )


def check_selection(token_budget: int | None, threshold: float | None) -> None:
    """Raise ValueError unless exactly one valid selection rule is given."""
    if (token_budget is None) == (threshold is None):
        raise ValueError("give exactly one of token_budget and threshold")
    if token_budget is not None and (not isinstance(token_budget, int) or token_budget < 0):
        raise ValueError(f"token_budget must be a non-negative int, got {token_budget!r}")
    if threshold is not None and not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be a probability in [0, 1), got {threshold!r}")


def select_blocks(
    logits: torch.Tensor,
    num_blocks: int | torch.Tensor,
    first_block: int | torch.Tensor,
    *,
    token_budget: int | None = None,
    threshold: float | None = None,
    block_size: int = 64,
) -> torch.Tensor:
    """Block indices int32 [B, H_kv, S] for one decode step (module docstring for the rules).

    logits [B, H_kv, N]: gate scores of the complete blocks 0..N-1 (-inf marks an invalid block);
    num_blocks, first_block: int or [B] — blocks in the row's cache (the current one included)
    and the row's first block holding a valid (non-padding) token. Exactly one of token_budget
    (tokens) and threshold (a probability) is given.
    """
    check_selection(token_budget, threshold)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(
            f"logits must be a [B, H_kv, N] tensor, got {getattr(logits, 'shape', logits)}"
        )
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    batch, heads, scored = logits.shape
    device = logits.device
    total = _per_row(num_blocks, batch, "num_blocks", device)
    first = _per_row(first_block, batch, "first_block", device)
    if isinstance(num_blocks, int) and isinstance(first_block, int):
        _check_rows(torch.tensor([num_blocks]), torch.tensor([first_block]), scored)
    elif debug_checks():
        _check_rows(total, first, scored)

    width = scored + 1  # room for a current block that is still partial, hence unscored
    block = torch.arange(width, device=device)
    current = total - 1
    forced = (block == current[:, None]) | (block == first[:, None])  # [B, width]
    scores = torch.cat([logits.float(), logits.new_full((batch, heads, 1), float("-inf"))], -1)
    candidate = (block >= first[:, None]) & (block < current[:, None])
    candidate = candidate[:, None, :] & torch.isfinite(scores)  # [B, H_kv, width]

    if token_budget is not None:
        keep_count = token_budget // block_size
        size = keep_count + 2
        ranked = torch.where(candidate & ~forced[:, None, :], scores, float("-inf"))
        top = min(keep_count, width)
        values, picked = ranked.topk(top, dim=-1)
        chosen = torch.zeros_like(candidate)
        chosen.scatter_(-1, picked, torch.isfinite(values))
    else:
        size = scored + 2
        masked = torch.where(candidate, scores, float("-inf"))
        # A row with no candidate has an all -inf row; its softmax would be NaN.
        probs = torch.where(candidate, masked.softmax(dim=-1), 0.0)
        chosen = candidate & (probs > threshold)

    chosen = chosen | forced[:, None, :]
    indices = torch.where(chosen, block, -1).sort(dim=-1, descending=True).values
    if indices.shape[-1] < size:
        indices = torch.nn.functional.pad(indices, (0, size - indices.shape[-1]), value=-1)
    return indices[..., :size].to(torch.int32).contiguous()
