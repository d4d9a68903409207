"""SeerAttention-R sparse decoding as a vLLM attention backend (vLLM 0.32.0; NOT run here).

`SeerSparseAttentionBackend` is vLLM's FlashAttention backend with one change in its
implementation: a batch of single-token decode steps (`max_query_len == 1`) attends only to the
blocks the layer's gate selects (`rstar_kernels.paged.paged_sparse_decode`: gate keys per full
page, the rotation of vLLM's post-RoPE cache undone for the gate, top-k or threshold selection,
the selected pages gathered for `sparse_decode`). Prefill and mixed prefill/decode batches stay
dense, as in the paper (spec §2.1). Each KV-cache write marks its pages for re-compression, so
pages that vLLM frees and reuses are never scored with stale gate keys.

Settings come from the environment, which vLLM's worker processes inherit:
RSTAR_GATE_CHECKPOINT (a `SeerGates` directory; required), RSTAR_SEER_TOKEN_BUDGET or
RSTAR_SEER_THRESHOLD (default: a 4,096-token budget, the paper's near-lossless setting) and
RSTAR_SEER_KERNEL (`triton`, the default, or `tilelang`). vLLM must run with
`block_size` = the gate's block size and `enforce_eager=True` (the selection has data-dependent
shapes, so the decode step cannot be captured in a CUDA graph).
"""

from __future__ import annotations

import os
import re
from functools import cache

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .gate import SeerGates
from .paged import HeadRotary, PagedGateKeys, paged_sparse_decode
from .vllm_plugin import BUDGET_ENV, GATE_ENV, KERNEL_ENV, THRESHOLD_ENV

DEFAULT_TOKEN_BUDGET = 4096


@cache
def _gates(path: str, device: str) -> SeerGates:
    return SeerGates.load(path, device=device).eval()


def _layer_index(layer_name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"cannot read a decoder layer index from vLLM layer {layer_name!r}")
    return int(match.group(1))


class SeerSparseAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SeerSparseAttentionImpl]:
        return SeerSparseAttentionImpl


class SeerSparseAttentionImpl(FlashAttentionImpl):
    _seer: tuple | None = None  # (gate, gate keys, rotary), built on the first call

    def _state(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> tuple:
        if self._seer is None:
            path = os.environ.get(GATE_ENV)
            if not path:
                raise RuntimeError(
                    f"the SeerAttention-R vLLM backend needs {GATE_ENV} (a gate checkpoint)"
                )
            gates = _gates(path, str(kv_cache.device))
            gate = gates[_layer_index(layer.layer_name)]
            num_pages = kv_cache.shape[1]  # (2, pages, page size, H_kv, D)
            self._seer = (
                gate,
                PagedGateKeys(gate, num_pages, kv_cache.device),
                HeadRotary(gates.config),
            )
        return self._seer

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self._state(layer, kv_cache)[1].mark_written(slot_mapping)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
    ):
        decode_only = attn_metadata is not None and attn_metadata.max_query_len == 1
        if not decode_only or output_scale is not None or kv_cache.numel() == 0:
            return super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        gate, gate_keys, rotary = self._state(layer, kv_cache)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        threshold = os.environ.get(THRESHOLD_ENV)
        budget = None if threshold else int(os.environ.get(BUDGET_ENV, DEFAULT_TOKEN_BUDGET))
        out = paged_sparse_decode(
            gate,
            gate_keys,
            rotary,
            query[:n].view(n, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            attn_metadata.block_table[:n],
            attn_metadata.seq_lens[:n],
            token_budget=budget,
            threshold=float(threshold) if threshold else None,
            backend=os.environ.get(KERNEL_ENV, "triton"),
            scale=self.scale,
        )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
