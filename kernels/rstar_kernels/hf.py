"""SeerAttention-R sparse decoding inside a Hugging Face transformers model
(docs/seer-attention.md).

`enable_seer_decoding(model, gates, token_budget=... | threshold=...)` registers the attention
implementation "seer" with transformers' `AttentionInterface` and switches the model to it:
- a forward whose keys are all new (a prefill: `model.generate`'s first step) runs dense SDPA and
  rebuilds each gated layer's `CompressedKeyCache` from the prompt's pre-RoPE keys, so every
  `generate()` call starts from fresh caches;
- a single-token step over a longer KV cache is a decode step: the layer's gate scores the
  compressed blocks with the token's pre-RoPE query (gate RoPE at its position id),
  `select_blocks` picks the blocks and `sparse_decode` attends to them over the model's own
  `DynamicCache` layer ([B, H_kv, L, D]);
- layers below `start_layer` stay dense throughout.
Pre-RoPE q and k come from `capture_pre_rope`'s hooks, held until `disable()`.

Left-padded batches: blocks are aligned to the padded cache (as the reference HF path does), the
padding is left out of pooling and attention through `starts` (each row's first valid position,
read from the prefill's attention mask; only left padding is accepted), and a block is rotated to
the position id of its first valid token. Where this departs from the paper / upstream code:
- blocks completed during decoding are rotated to their first valid token's position, as in
  training, not to the completing token's (upstream inference);
- the first valid block is forced on through the index list (upstream forces it inside the
  mask-based kernel), and the current block is never a top-k candidate (module `selection`);
- a batch that grows by a whole factor between the prefill and the first decode step (n samples
  sharing one prompt prefill) repeats each row's state in place, as `Cache.batch_repeat_interleave`
  does; that step (the prompt's last token) is then already a sparse decode step;
- rows are never dropped when they finish (upstream drops them from both caches); beam search
  and other cache reordering are not supported.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any

import torch

from .cache import CompressedKeyCache
from .decode import BACKENDS, sparse_decode
from .gate import GateConfig, SeerGates, capture_pre_rope, decoder_layers
from .selection import check_selection, select_blocks

ATTENTION_NAME = "seer"
# Fields of GateConfig that must equal the model's for the gates to fit it.
_SHAPE_FIELDS = ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta")


class _GatedLayer:
    """What one gated attention layer keeps between calls (a plain object, not a submodule, so
    the model's state_dict is untouched)."""

    def __init__(self, gate, captured: dict[str, torch.Tensor], settings: dict[str, Any]):
        self.gate = gate
        self.cache = CompressedKeyCache(gate)
        self.captured = captured
        self.settings = settings
        self.starts: torch.Tensor | None = None  # int32 [B]

    def prefill(self, attention_mask, position_ids, length: int) -> None:
        k = self.captured["k"]
        batch = k.shape[0]
        valid = _valid_keys(attention_mask, batch, length, k.device)
        self.starts = torch.where(valid.any(dim=1), valid.to(torch.int8).argmax(dim=1), length).to(
            torch.int32
        )
        positions = torch.arange(length, device=k.device)
        if bool((valid != (positions >= self.starts[:, None])).any()):
            raise ValueError(
                "seer decoding needs left padding: each row's valid tokens must be contiguous "
                "up to the end of the prompt"
            )
        if position_ids is None:
            position_ids = (positions - self.starts[:, None]).clamp(min=0)
        self.cache.prefill(k, valid, position_ids.expand(batch, length))

    def decode(self, query, key, value, position_ids, scaling):
        if self.starts is None:
            raise RuntimeError("a seer decode step came before any prefill through this model")
        batch, length = key.shape[0], key.shape[2]
        if batch != self.starts.shape[0]:
            self._repeat_rows(batch)
        if position_ids is None:
            position_ids = (length - 1 - self.starts[:, None]).long()
        position_ids = position_ids.expand(batch, 1)
        self.cache.append(self.captured["k"], position_ids[:, 0])
        if self.cache.length != length:
            raise RuntimeError(
                f"the compressed key cache holds {self.cache.length} tokens but the KV cache "
                f"{length}: generate() must start from a prefill through this model"
            )
        gq = self.gate.query(self.captured["q"], position_ids)
        logits = self.gate.logits(gq, self.cache.keys, self.cache.block_valid)[:, :, 0]
        block_size = self.cache.block_size
        indices = select_blocks(
            logits,
            math.ceil(length / block_size),
            (self.starts // block_size).long(),
            token_budget=self.settings["token_budget"],
            threshold=self.settings["threshold"],
            block_size=block_size,
        )
        seqlens = torch.full((batch,), length, dtype=torch.int32, device=key.device)
        out = sparse_decode(
            query[:, :, 0],
            key,
            value,
            indices,
            seqlens,
            block_size,
            self.settings["backend"],
            starts=self.starts,
            scale=scaling,
        )
        return out[:, None], None  # [B, 1, H_q, D], as the other attention functions return

    def _repeat_rows(self, batch: int) -> None:
        rows = self.starts.shape[0]
        if batch % rows:
            raise RuntimeError(
                f"the batch changed from {rows} rows at prefill to {batch} while decoding; seer "
                "decoding follows only whole-factor growth (n samples per prompt)"
            )
        self.starts = self.starts.repeat_interleave(batch // rows)
        self.cache.batch_repeat_interleave(batch // rows)


def _valid_keys(attention_mask, batch: int, length: int, device) -> torch.Tensor:
    """bool [B, L]: the keys the prompt's last query may attend (every non-padding token)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, :length]
    # A float (additive) mask marks allowed keys with 0, a bool mask with True.
    last = last if last.dtype == torch.bool else last == 0
    return last.expand(batch, length)


def seer_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The "seer" entry of transformers' AttentionInterface (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = getattr(module, "_seer_layer", None)
    new_tokens, length = query.shape[2], key.shape[2]
    if layer is not None and new_tokens == 1 and length > 1:
        return layer.decode(query, key, value, kwargs.get("position_ids"), scaling)
    if layer is not None:
        if new_tokens != length:
            raise ValueError(
                f"seer decoding runs a prefill from an empty cache and then one token per step; "
                f"got {new_tokens} new tokens over a cache of {length}"
            )
        layer.prefill(attention_mask, kwargs.get("position_ids"), length)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, seer_attention_forward)
    # Prefill falls through to SDPA, so it needs the masks SDPA gets.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def check_gates_fit(gates: SeerGates, model) -> None:
    """Raise ValueError naming each shape field where the gates' config differs from the model."""
    mine = GateConfig.for_model(model.config)
    wrong = [
        f"{name}: gates {getattr(gates.config, name)!r}, model {getattr(mine, name)!r}"
        for name in _SHAPE_FIELDS
        if getattr(gates.config, name) != getattr(mine, name)
    ]
    if wrong:
        base = gates.config.base_model or "another model"
        raise ValueError(
            f"these gates (trained for {base}) do not fit the model: {'; '.join(wrong)}"
        )


class SeerDecoding:
    """Sparse decoding switched on for one model; `disable()` (or leaving a `with` block) restores
    its previous attention implementation and removes the hooks."""

    def __init__(self, model, gates: SeerGates, *, token_budget, threshold, backend, start_layer):
        check_selection(token_budget, threshold)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_gates_fit(gates, model)
        layers = decoder_layers(model)
        if not 0 <= start_layer <= len(layers):
            raise ValueError(f"start_layer must be in [0, {len(layers)}], got {start_layer}")
        if hasattr(model, "_seer_decoding"):
            raise ValueError("seer decoding is already enabled on this model")
        _register()
        self.model = model
        self.gates = gates.to(model.device)
        self._previous = model.config._attn_implementation
        self._hooks = contextlib.ExitStack()
        captured = self._hooks.enter_context(capture_pre_rope(model))
        settings = {"token_budget": token_budget, "threshold": threshold, "backend": backend}
        for index in range(start_layer, len(layers)):
            state = _GatedLayer(self.gates[index], captured[index], settings)
            layers[index].self_attn._seer_layer = state
        model.set_attn_implementation(ATTENTION_NAME)
        # The model keeps its handle: the capture hooks live as long as the handle does.
        model._seer_decoding = self

    def disable(self) -> None:
        for layer in decoder_layers(self.model):
            if hasattr(layer.self_attn, "_seer_layer"):
                del layer.self_attn._seer_layer
        self._hooks.close()
        self.model.set_attn_implementation(self._previous)
        del self.model._seer_decoding

    def __enter__(self) -> SeerDecoding:
        return self

    def __exit__(self, *exc_info) -> None:
        self.disable()


def enable_seer_decoding(
    model,
    gates: SeerGates,
    *,
    token_budget: int | None = None,
    threshold: float | None = None,
    backend: str = "torch",
    start_layer: int = 0,
) -> SeerDecoding:
    """Switch `model` (llama, qwen2 or qwen3) to sparse decoding with `gates`; exactly one of
    token_budget (tokens read per step beyond the current and first blocks) and threshold (gate
    probability). Returns the handle that disables it, also usable as a context manager."""
    return SeerDecoding(
        model,
        gates,
        token_budget=token_budget,
        threshold=threshold,
        backend=backend,
        start_layer=start_layer,
    )


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands `model` its key/value cache: `cache` from transformers 5.24 on
    (`past_key_values` is deprecated there), `past_key_values` before; an unknown keyword would
    be swallowed by the model's **kwargs and the cache silently left unfilled."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # Once per class: reading the signature costs ~20 us, and decode loops ask every step.
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
