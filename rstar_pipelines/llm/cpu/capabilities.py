"""Probes of the private torch and transformers APIs the CPU speed-ups use.

Private APIs change between releases without notice; pyproject bounds torch and transformers to
the releases these were tested with, and each use still asks its probe first. A probe runs once
a process: it calls the API on a tiny input (or looks the names up), and where that fails the
caller takes a public fallback, with one warning naming what is missing and what runs instead:

- `int8_packed_matmul`: `aten._weight_int8pack_mm`; else int8 layers run the matmul over their
  integers (`quantized_linear`).
- `int4_packed_matmul`: `aten._convert_weight_to_int4pack_for_cpu` and
  `aten._weight_int4pack_mm_for_cpu`; else int4 layers run the matmul over their dequantized
  weights.
- `flash_attention_lse`: `aten._scaled_dot_product_flash_attention_for_cpu` (attention with its
  log-sum-exp); else cascade attention computes both with public ops (`cascade_attention`).
- `attention_registry`: transformers' `AttentionInterface`, `masking_utils.AttentionMaskInterface`
  and `sdpa_mask`, `integrations.sdpa_attention.sdpa_attention_forward`; else models keep SDPA.
- `cache_layers`: `transformers.cache_utils.DynamicLayer` and `DynamicCache.layers`; else calls
  generate through `generate()`, as on the plain path (`backend`).
- `generation_internals`: `GenerationMixin._get_logits_processor` and
  `_prepare_generation_config`, which the decode loop draws with; else `generate()`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# What a private API that is missing or changed raises when called or looked up.
PROBE_ERRORS = (AttributeError, ImportError, NotImplementedError, RuntimeError, TypeError)


def _probe(api: str, fallback: str, check: Callable[[], object]) -> bool:
    try:
        check()
    except PROBE_ERRORS as error:
        log.warning(
            "%s does not work here (%s: %s); %s", api, type(error).__name__, error, fallback
        )
        return False
    return True


def _check_int8() -> None:
    import torch

    rows = torch.ones(1, 32, dtype=torch.bfloat16)
    weight = torch.ones(16, 32, dtype=torch.int8)
    out = torch.ops.aten._weight_int8pack_mm(rows, weight, torch.ones(16, dtype=torch.bfloat16))
    if out.shape != (1, 16) or out[0, 0].item() != 32:
        raise RuntimeError(f"1 x 32 ones times 16 x 32 ones gave {out.shape} {out[0, 0].item()}")


def _check_int4() -> None:
    import torch

    q = torch.full((16, 32), 9, dtype=torch.int32)  # (9 - 8) * scale 1 + zero 0 = 1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    grid = torch.stack([torch.ones(1, 16), torch.zeros(1, 16)], dim=-1).to(torch.bfloat16)
    rows = torch.ones(1, 32, dtype=torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, 32, grid)
    if out.shape != (1, 16) or out[0, 0].item() != 32:
        raise RuntimeError(f"1 x 32 ones times 16 x 32 ones gave {out.shape} {out[0, 0].item()}")


def _check_flash() -> None:
    import torch

    query = torch.ones(1, 1, 2, 8)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, query, query, attn_mask=None, scale=1.0
    )[:2]
    if out.shape != (1, 1, 2, 8) or lse.shape != (1, 1, 2):
        raise RuntimeError(f"shapes {tuple(out.shape)} and {tuple(lse.shape)}")


def _check_registry() -> None:
    from transformers import AttentionInterface  # noqa: F401
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401


def _check_cache_layers() -> None:
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache, DynamicLayer

    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=1)
    if not all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers):
        raise TypeError("DynamicCache's layers are not DynamicLayers")


def _check_generation() -> None:
    from transformers import GenerationMixin

    GenerationMixin._get_logits_processor  # noqa: B018
    GenerationMixin._prepare_generation_config  # noqa: B018


@functools.cache
def int8_packed_matmul() -> bool:
    return _probe(
        "torch.ops.aten._weight_int8pack_mm",
        "int8 layers run the matmul over their integers",
        _check_int8,
    )


@functools.cache
def int4_packed_matmul() -> bool:
    return _probe(
        "torch.ops.aten._weight_int4pack_mm_for_cpu",
        "int4 layers run the matmul over their dequantized weights",
        _check_int4,
    )


@functools.cache
def flash_attention_lse() -> bool:
    return _probe(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "cascade attention computes attention and its log-sum-exp with public ops",
        _check_flash,
    )


@functools.cache
def attention_registry() -> bool:
    return _probe(
        "transformers' attention and mask registries (AttentionMaskInterface, sdpa_mask)",
        "models keep SDPA instead of cascade attention",
        _check_registry,
    )


@functools.cache
def cache_layers() -> bool:
    return _probe(
        "transformers.cache_utils.DynamicLayer",
        "generation runs through generate() with transformers' own cache",
        _check_cache_layers,
    )


@functools.cache
def generation_internals() -> bool:
    return _probe(
        "GenerationMixin._get_logits_processor and _prepare_generation_config",
        "generation runs through generate() instead of the decode loop",
        _check_generation,
    )


PROBES = (
    int8_packed_matmul,
    int4_packed_matmul,
    flash_attention_lse,
    attention_registry,
    cache_layers,
    generation_internals,
)


def forget() -> None:
    """Run every probe again on its next use (tests that make one fail)."""
    for probe in PROBES:
        probe.cache_clear()
