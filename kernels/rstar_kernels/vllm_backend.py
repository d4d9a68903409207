"""SeerAttention-R sparse decoding as a vLLM attention backend (vLLM 0.32.0; NOT run here).

`SeerSparseAttentionBackend` is vLLM's FlashAttention backend with one change in its
implementation: a batch of single-token decode steps (`max_query_len == 1`) attends only to the
blocks the layer's gate selects. This module is a thin shell: what touches vLLM's tensors (the
cache layout, the key/value split, the page bookkeeping, the gather of the selected pages) is
`vllm_layout.SeerLayer`, tested on CPU tensors in vLLM's layout. Prefill and mixed batches stay
dense, as in the paper. Each cache write marks its pages for re-compression, so pages that vLLM
frees and reuses are never scored with stale gate keys.

A layer stays dense, with a warning, when its cache is fp8 or it is not a plain decoder
self-attention layer (sliding window, encoder, decode context parallelism). A worker whose heads
are not the gates' (tensor parallelism above 1) is refused when vLLM builds the layer.

Settings: `vllm_plugin.settings_from_env`. vLLM must run with `block_size` = the gates' block
size and `enforce_eager=True` (the selection has data-dependent shapes, so the decode step cannot
be captured in a CUDA graph).
"""

from __future__ import annotations

import logging
import re
from functools import cache

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .gate import SeerGates
from .vllm_layout import SeerLayer, check_layer_heads, sparse_kv_cache_dtype
from .vllm_plugin import load_gate_config, settings_from_env

logger = logging.getLogger(__name__)


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
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._path, self._selection = settings_from_env()
        self._seer: SeerLayer | None = None
        self._dense_reason = self._why_dense()
        if self._dense_reason:
            logger.warning("SeerAttention-R: this layer decodes densely: %s", self._dense_reason)
        else:
            check_layer_heads(
                load_gate_config(self._path), self.num_heads, self.num_kv_heads, self.head_size
            )

    def _why_dense(self) -> str | None:
        if not sparse_kv_cache_dtype(self.kv_cache_dtype):
            return f"kv_cache_dtype={self.kv_cache_dtype!r} (the gates read fp16/bf16 keys)"
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.sliding_window != (-1, -1):
            return f"sliding window {self.sliding_window}"
        if self.dcp_world_size > 1:
            return "decode context parallelism splits the tokens across workers"
        return None

    def _layer(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> SeerLayer:
        if self._seer is None:
            gates = _gates(self._path, str(kv_cache.device))
            self._seer = SeerLayer(gates[_layer_index(layer.layer_name)], self._selection)
        return self._seer

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if not self._dense_reason:
            self._layer(layer, kv_cache).mark_written(kv_cache, slot_mapping)

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
        fused_output = output_scale is not None or output_block_scale is not None
        if self._dense_reason or not decode_only or fused_output or kv_cache.numel() == 0:
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
        n = attn_metadata.num_actual_tokens
        out = self._layer(layer, kv_cache).decode(
            query[:n], kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, self.scale
        )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
