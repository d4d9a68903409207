"""SeerAttention-R sparse decoding as a vLLM attention backend (vLLM 0.32.0; NOT run here).

`SeerSparseAttentionBackend` is vLLM's FlashAttention backend with one change: the decode rows
of every step (one new token each) attend only to the blocks the layer's gate selects, whether
the step holds prefill chunks too or not, so a request's tokens do not depend on what it is
batched with. The decode rows come first (the V1 model runner reorders the batch by the
builder's `reorder_batch_threshold` 1; the V2 runner, vLLM 0.32.0's default, always sorts decodes
first: `vllm/v1/worker/gpu/model_runner.py`, `sort_batch_req_ids`) and the builder counts the
leading ones on the host (`split_decodes_and_prefills`, from the CPU copy of the query offsets),
so the forward needs no device read: a pure decode step runs the sparse path alone; a
mixed step runs FlashAttention over every token, then overwrites the decode rows' outputs. This
module is a thin shell: what touches vLLM's tensors (the cache layout, the key/value split, the
page bookkeeping, the gather of the selected pages) is `vllm_layout.SeerLayer`, tested on CPU
tensors in vLLM's layout. Each cache write marks its pages for re-compression, so pages that
vLLM frees and reuses are never scored with stale gate keys.

CUDA graphs: the sparse decode step has shapes fixed by the batch size and reads nothing back
on the host, so the builder declares `UNIFORM_SINGLE_TOKEN_DECODE`: vLLM captures full graphs of
pure decode steps (sparse path included) and runs mixed steps piecewise, attention outside the
graphs (`vllm/v1/attention/backend.py`, `AttentionCGSupport`).

A layer stays dense, with a warning, when its cache is fp8 or it is not a plain decoder
self-attention layer (sliding window, encoder, decode context parallelism). A worker whose heads
are not the gates' (tensor parallelism above 1) is refused when vLLM builds the layer.

Settings: `vllm_plugin.settings_from_env`. vLLM must run with `block_size` = the gates' block
size.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from functools import cache

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .gate import SeerGates
from .vllm_layout import SeerLayer, check_layer_heads, sparse_kv_cache_dtype
from .vllm_plugin import load_gate_config, settings_from_env

logger = logging.getLogger(__name__)


@cache
def _gates(path: str, device: str) -> SeerGates:
    return SeerGates.load(path, device=device).eval()


def _worker_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _layer_index(layer_name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"cannot read a decoder layer index from vLLM layer {layer_name!r}")
    return int(match.group(1))


@dataclasses.dataclass
class SeerMetadata(FlashAttentionMetadata):
    # Requests at the front of the (reordered) batch with one new token each.
    num_seer_decodes: int = 0


class SeerMetadataBuilder(FlashAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return cls._cudagraph_support

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> SeerMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        num_decodes, _, _, _ = split_decodes_and_prefills(common_attn_metadata, 1)
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return SeerMetadata(**fields, num_seer_decodes=num_decodes)


class SeerSparseAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SeerSparseAttentionImpl]:
        return SeerSparseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SeerMetadataBuilder]:
        return SeerMetadataBuilder


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
            # Loaded while vLLM builds the model, so its memory profile counts the gates.
            _gates(self._path, _worker_device())

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
            gates = _gates(self._path, _worker_device())
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
        fused_output = output_scale is not None or output_block_scale is not None
        num_decodes = getattr(attn_metadata, "num_seer_decodes", 0)
        dense_only = (
            attn_metadata is None or self._dense_reason or fused_output or kv_cache.numel() == 0
        )
        if dense_only or num_decodes < attn_metadata.seq_lens.shape[0]:
            # Prefill chunks (and, in a mixed step, the decode rows, overwritten below).
            super().forward(
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
        if dense_only:
            return output
        seer = self._layer(layer, kv_cache)
        if num_decodes == 0:  # a prefill-only step: its full pages are compressed as written
            seer.refresh(
                kv_cache,
                attn_metadata.block_table,
                attn_metadata.seq_lens,
                attn_metadata.num_actual_tokens,
            )
            return output
        out = seer.decode(
            query,
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            self.scale,
            num_decodes=num_decodes,
            num_tokens=attn_metadata.num_actual_tokens,
        )
        output[:num_decodes].copy_(out.reshape(output[:num_decodes].shape))
        return output
