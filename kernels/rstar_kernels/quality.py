"""How far sparse decoding strays from dense decoding on a text: next-token distributions under
teacher forcing (the prefix prefilled densely, then one token a step, each a decode step), and the
KL divergence and top-1 agreement between two such runs."""

from __future__ import annotations

import torch


def teacher_forced_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Next-token logits [T - prefill, V] at positions prefill-1 .. T-2 of the 1-D token ids:
    one prefill of the first `prefill` tokens, then one token a step through the model's cache
    (with seer decoding enabled, every step after the prefill is a sparse decode step)."""
    from transformers import DynamicCache

    from .hf import cache_argument

    if not 1 <= prefill < ids.shape[0]:
        raise ValueError(f"prefill must be in [1, {ids.shape[0] - 1}] for {ids.shape[0]} tokens")
    cache = DynamicCache(config=model.config)
    ids = ids.to(model.device)
    with torch.inference_mode():
        out = model(input_ids=ids[None, :prefill], **cache_argument(model, cache), use_cache=True)
        logits = [out.logits[0, -1]]
        for t in range(prefill, ids.shape[0] - 1):
            out = model(
                input_ids=ids[None, t : t + 1], **cache_argument(model, cache), use_cache=True
            )
            logits.append(out.logits[0, -1])
    return torch.stack(logits).float()


def kl_and_agreement(dense: torch.Tensor, sparse: torch.Tensor) -> tuple[float, float]:
    """Mean over steps of KL(dense ‖ sparse) of the next-token distributions, and the share of
    steps whose most likely token is the same."""
    if dense.shape != sparse.shape:
        raise ValueError(f"logits of different shapes: {tuple(dense.shape)} and {sparse.shape}")
    log_p, log_q = dense.log_softmax(-1), sparse.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    agree = (dense.argmax(-1) == sparse.argmax(-1)).float().mean().item()
    return kl, agree
