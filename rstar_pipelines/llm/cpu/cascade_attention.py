"""Cascade attention on the CPU: the rows that share a prompt read its keys and values once.

n samples of a prompt (candidate solutions: 3, an MCTS expansion: 4) each held a copy of the
prompt's keys and values, and every decode step read all n copies: with prompts of hundreds of
tokens attention is a large share of a small model's decode step, and reading the cache is most
of its cost (docs/benchmarks.md). With a cache whose repeated rows share what
they came from (`kv_cache.PreallocatedLayer`, `share_repeats`), a layer's attention runs in two
parts: the rows of each group stacked as the queries of one attention over the group's shared
keys, and each row over its own (the tokens it generated), the two merged by their
log-sum-exps, which is attention over the whole row exactly, up to float rounding. This is the
cascade (shared-prefix) attention of serving engines (FlashInfer's, vLLM's), here on a decode
kernel of our own (`kernels.decode_attention_cpu`) or torch's CPU flash-attention kernel,
both of which return the log-sum-exp.

`cascade_attention_forward` is registered with transformers' AttentionInterface as
`ATTENTION_NAME`; a model switched to it (`use_cascade_attention`) attends as SDPA does for any
cache that shares nothing (its decode steps through the same kernel of ours), and reads the
shared part of the cache handed as the `CACHE_KWARG` keyword of its forward (`model_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import capabilities
from .kernels.decode_attention_cpu import decode_attention

ATTENTION_NAME = "rstar_cascade"
# The keyword of the model's forward that carries the cache whose shared parts attention reads.
CACHE_KWARG = "cascade_cache"


def use_cascade_attention(model: Any) -> bool:
    """Switch `model` to cascade attention where it attends with SDPA on the CPU (others keep
    their attention); whether it is switched."""
    current = model.config._attn_implementation
    if current == ATTENTION_NAME:
        return True
    if current != "sdpa" or model.device.type != "cpu" or not capabilities.attention_registry():
        return False
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    return True


def model_inputs(model: Any, cache: Any) -> dict[str, Any]:
    """The keywords that hand `model` its key/value cache (and, to cascade attention, its
    shared parts)."""
    from rstar_kernels.hf import cache_argument

    inputs = cache_argument(model, cache)
    if model.config._attn_implementation == ATTENTION_NAME:
        inputs[CACHE_KWARG] = cache
    return inputs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, cascade_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def cascade_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function: where the layer's cache shares nothing, SDPA (a decode
    step through our kernel where it takes it), else attention over the shared part and the own
    part (`key`, `value`), merged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = kwargs.pop(CACHE_KWARG, None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if getattr(layer, "shared_keys", None) is None:
        if query.shape[2] == 1 and not dropout:
            out = _decode_step(query, key, value, attention_mask, scaling)
            if out is not None:
                return out, None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("cascade attention is for inference: dropout must be 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    masks = _split_mask(cache, attention_mask, layer, query)
    shared_out, shared_lse = _shared_part(query, layer, masks.shared, scale)
    if masks.unseen_groups is not None:
        shared_lse = shared_lse.masked_fill(masks.unseen_groups, float("-inf"))
    own_out, own_lse = _own_part(query, key, value, masks.own, scale)
    # Softmax over both parts: each part's result weighted by its share of the total mass.
    weight = torch.sigmoid(shared_lse - own_lse).unsqueeze(-1)
    out = torch.lerp(own_out, shared_out, weight)
    return out.transpose(1, 2).contiguous(), None


def _decode_step(query, key, value, mask, scaling) -> torch.Tensor | None:
    """A decode step's attention over a cache that shares nothing (every row its own prompt),
    through our kernel as the own part's: [rows, 1, heads, dim] as SDPA returns it, or None
    where the kernel does not take the inputs."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    ours = decode_attention(grouped, key, value, mask, scale)
    if ours is None:
        return None
    return ours[0].reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class _Masks:
    mask: torch.Tensor | None  # what transformers gave, [rows, 1, T, shared + own] or None
    shared: torch.Tensor | None  # additive, [groups, 1, 1, shared]
    own: torch.Tensor | None  # additive, [rows, 1, T, own]
    unseen_groups: torch.Tensor | None  # [rows, 1, 1]: rows whose group may attend no shared key


def _split_mask(cache: Any, mask: torch.Tensor | None, layer: Any, query: torch.Tensor) -> _Masks:
    """The mask of each part, made once per forward: transformers hands every layer the same
    mask, and every layer of the cache has the same groups."""
    made = getattr(cache, "_cascade_masks", None)
    if made is not None and made.mask is mask:
        return made
    if mask is None:
        made = _Masks(None, None, None, None)
    else:
        length = layer.shared_length
        if mask.dtype == torch.bool:
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
            additive.masked_fill_(~mask, float("-inf"))
        else:
            additive = mask.to(query.dtype)
        additive = additive.expand(query.shape[0], -1, -1, -1)
        # A group's rows see its shared keys alike, from every query (they come before all);
        # the CPU kernel reports a query that may attend no key with a log-sum-exp of 0.
        shared = additive[layer.groups.first_row, :, -1:, :length]
        unseen = torch.isinf(shared).all(dim=-1).view(-1)
        unseen_rows = unseen[layer.groups.group_of_row].view(-1, 1, 1) if unseen.any() else None
        made = _Masks(mask, shared, additive[..., length:], unseen_rows)
    cache._cascade_masks = made
    return made


def _flash(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp per query: a decode step's few queries through our kernel
    where it takes them (`kernels.decode_attention_cpu`: about twice as fast), else
    torch's CPU flash kernel."""
    ours = decode_attention(query, key, value, mask, scale)
    if ours is not None:
        return ours
    if not capabilities.flash_attention_lse():
        return attention_with_lse(query, key, value, mask, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=mask, scale=scale
    )
    return out, lse


def attention_with_lse(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """`_flash`'s attention and log-sum-exp with public ops, where torch's CPU flash kernel is
    not there (`capabilities.flash_attention_lse`): a query that sees no key gets zeros and a
    log-sum-exp of -inf, as from the flash kernel."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    weights = torch.exp(scores - finite.unsqueeze(-1))
    return torch.matmul(weights.to(value.dtype), value), lse


def _shared_part(query, layer, mask, scale):
    """[rows, heads, T, dim] attention of every row over its group's shared keys, and the
    [rows, heads, T] log-sum-exps: one kernel call whose queries are all rows of a group, with
    all heads that read one key/value head (grouped-query attention); groups of fewer rows than
    the largest are padded."""
    rows, heads, length, dim = query.shape
    groups, width = layer.groups, layer.groups.width
    count, kv_heads = layer.shared_keys.shape[0], layer.shared_keys.shape[1]
    per_kv = heads // kv_heads
    if groups.uniform:
        stacked = query.reshape(count, width, kv_heads, per_kv, length, dim)
    else:
        stacked = query.new_zeros(count, width, heads, length, dim)
        stacked[groups.group_of_row, groups.slot] = query
        stacked = stacked.view(count, width, kv_heads, per_kv, length, dim)
    # [groups, kv heads, width * heads per kv head * T, dim]
    stacked = stacked.transpose(1, 2).reshape(count, kv_heads, width * per_kv * length, dim)
    out, lse = _flash(stacked, layer.shared_keys, layer.shared_values, mask, scale)
    out = out.reshape(count, kv_heads, width, per_kv, length, dim).transpose(1, 2)
    lse = lse.reshape(count, kv_heads, width, per_kv, length).transpose(1, 2)
    if groups.uniform:
        return out.reshape(rows, heads, length, dim), lse.reshape(rows, heads, length)
    out = out.reshape(count, width, heads, length, dim)[groups.group_of_row, groups.slot]
    lse = lse.reshape(count, width, heads, length)[groups.group_of_row, groups.slot]
    return out, lse


def _own_part(query, keys, values, mask, scale):
    """[rows, heads, T, dim] attention of every row over its own keys and the log-sum-exps; one
    query a row reads its key/value heads once for all heads that share them."""
    rows, heads, length, dim = query.shape
    kv_heads = keys.shape[1]
    per_kv = heads // kv_heads
    if length == 1:
        out, lse = _flash(query.view(rows, kv_heads, per_kv, dim), keys, values, mask, scale)
        return out.reshape(rows, heads, 1, dim), lse.reshape(rows, heads, 1)
    keys = keys.repeat_interleave(per_kv, dim=1)
    values = values.repeat_interleave(per_kv, dim=1)
    return _flash(query, keys, values, mask, scale)
