"""The transformers backend with the CPU speed-ups: `CpuTransformersLLM`, the plain backend
(`llm.transformers_backend.TransformersLLM`) with its generation replaced where a model's cache
allows.

What it changes:
- `quantization` (module `quantization`): "int4" runs the decoder layers' linear layers with
  4-bit weights (the GGUF file's own grid) and the LM head as int8 on the CPU, the default for
  the embedded model on a CPU; "int8" runs every linear layer as int8; "none" keeps the loaded
  weights, the default otherwise. The scheme is part of the name, and so is the backend's
  revision (`transformers@6:embedded+int4`, `TRANSFORMERS_REVISION`), so cached completions of
  one scheme, or of older code, are never taken for another's.
- Rows leave a batch as they end, so a wide batch costs little once most of its rows are done
  (module `decode_loop`). Leading tokens that all prompts of a batch share (a few-shot preamble,
  at least `decode_loop.MIN_SHARED_PREFIX`; a lone prompt's tokens but the last) run once, and
  only from where the model's stored prefixes stop: each batch's shared prefix is kept for later
  calls (module `prefix_cache`, 512 MiB a model), so an MCTS expansion computes only the step its
  tree added since the last one.
- Every sampled row draws from a random stream of its own (`decode_loop.RowSeeds`), seeded from
  `params.seed`, its prompt and its copy: a prompt draws the same random numbers whatever else is
  in the call or the batch (its logits can still differ in the last bits with the batch's
  padding: float32 keeps the samples equal, the quantized schemes' bfloat16 activations can move
  a draw). Samples are drawn from `generate()`'s distribution (its logits processors,
  temperature, top-k 50 unless the model says otherwise, top-p) over the top-k candidates alone.
- Sampling n > 1 completions prefills each prompt once (all its tokens but the last) and copies
  that key/value cache n times, instead of prefilling every copy.
- The key/value cache is allocated for the whole call up front and appended in place (module
  `kv_cache`), instead of being copied every step.
- On the CPU, dense models attend with cascade attention (module `cascade_attention`): the n
  samples of a prompt (and the prompts of a shared preamble) keep its keys and values once, and
  each decode step reads them once for all of them.
Models whose cache is not plain full-attention keys and values (sliding windows, recurrent
states) generate as on the plain path, through `generate()`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from rstar_kernels.hf import ATTENTION_NAME as SEER_ATTENTION

from .. import transformers_backend as plain
from ..devices import default_device
from ..embedded import trained_from_embedded
from ..sparse import SeerSettings
from ..stop_strings import StopStrings
from ..types import Completion, SamplingParams
from . import capabilities
from .cascade_attention import ATTENTION_NAME as CASCADE_ATTENTION
from .cascade_attention import model_inputs, use_cascade_attention
from .decode_loop import (
    RowSeeds,
    TokenPicker,
    decode,
    first_positions,
    shared_prefix_length,
)
from .prefix_cache import PrefixCache
from .quantization import quantize, resolve_quantization, tag
from .quantized_linear import kernel_for_batch

# The stored prompt prefixes of each loaded model, shared by every CpuTransformersLLM over it.
_prefix_caches: weakref.WeakKeyDictionary[Any, PrefixCache] = weakref.WeakKeyDictionary()
_prefix_lock = threading.Lock()


def load_model_and_tokenizer(
    model: str = "embedded",
    device: str | None = None,
    dtype: str = "auto",
    seer: SeerSettings | None = None,
    quantization: str | None = "none",
) -> tuple[Any, Any]:
    """`transformers_backend.load_model_and_tokenizer` with the linear layers quantized
    (`quantization`) and, for dense decoding on the CPU, cascade attention. A checkpoint
    trained from the embedded model, under "int4", keeps the embedded model's grid (module
    `quantization`)."""
    device = default_device(device)
    quantization = resolve_quantization(quantization, model, device)
    grid = None
    if quantization == "int4" and model != "embedded" and trained_from_embedded(model):
        grid = load_model_and_tokenizer("embedded", device, dtype, quantization="int4")[0]
    prepare = functools.partial(_prepare, quantization=quantization, grid=grid, dense=seer is None)
    return plain.load_prepared(model, device, dtype, seer, f"cpu:{quantization}", prepare)


def _prepare(model: Any, quantization: str, grid: Any, dense: bool) -> Any:
    model = quantize(model, quantization, grid)
    if dense:
        use_cascade_attention(model)
    return model


class CpuTransformersLLM(plain.TransformersLLM):
    """`TransformersLLM` with the CPU speed-ups (module docstring)."""

    def __init__(self, model: str = "embedded", **options: Any):
        super().__init__(model, **options)
        with _prefix_lock:
            self.prefix_cache = _prefix_caches.setdefault(self._model, PrefixCache())

    resolve_quantization = staticmethod(resolve_quantization)
    tag = staticmethod(tag)
    load_model_and_tokenizer = staticmethod(load_model_and_tokenizer)

    def _row_seeds(self, token_ids: list[list[int]], params: SamplingParams) -> RowSeeds | None:
        if params.temperature <= 0:
            return None
        return RowSeeds.for_call(params.seed, token_ids, params.n)

    def _generate_batch(
        self, batch: list[list[int]], params: SamplingParams, seeds: RowSeeds | None
    ) -> list[list[Completion]]:
        width = max(len(ids) for ids in batch)
        copies = params.n if params.temperature > 0 else 1
        with torch.inference_mode():
            cache = self._new_cache(width + params.max_tokens)
            if cache is None:
                return super()._generate_batch(batch, params, seeds)
            # SeerAttention-R's sparse layers take left padding and one prefill only.
            prefix = shared_prefix_length(batch) if not self._seer else 0
            ids, mask = plain.padded_batch(batch, prefix, self._pad_id)
            input_ids = torch.tensor(ids, device=self._model.device)
            attention_mask = torch.tensor(mask, device=self._model.device)
            if prefix:
                self._prefill_shared_prefix(input_ids[:1, :prefix], cache, len(batch))
            rows = self._decode(input_ids, attention_mask, cache, params, copies, seeds)
        return self._grouped(batch, rows, params, copies)

    def _decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
        params: SamplingParams,
        copies: int,
        seeds: RowSeeds | None,
    ) -> list[list[int]]:
        """Row i's copies at i * copies + j, each the tokens it generated (module
        `decode_loop`)."""
        if copies > 1:
            self._shared_prefill(input_ids, attention_mask, cache)
            # Row i's copies sit at i * copies + j, as num_return_sequences would place them.
            cache.batch_repeat_interleave(copies)
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        pick = TokenPicker(
            self._model, self._generation_config(params), input_ids.shape[1], input_ids.device
        )
        stops = StopStrings(self._tokenizer, params.stop, len(input_ids)) if params.stop else None
        # One quantized kernel for the whole call: rows leaving the batch change no other row.
        with kernel_for_batch(self._model, len(input_ids)):
            return decode(
                self._model,
                input_ids,
                attention_mask,
                cache,
                max_new_tokens=params.max_tokens,
                pick=pick,
                seeds=seeds,
                eos_ids=self._eos_ids,
                stops=stops,
                # SeerAttention-R keeps per-row compressed keys outside the cache.
                drop_finished=not self._seer,
            )

    def _generation_config(self, params: SamplingParams) -> Any:
        """The call's generation config as `generate()` makes it (`_generation_options`, then the
        model's own, then transformers' defaults), which `TokenPicker` reads."""
        options = self._generation_options(params)
        config, _ = self._model._prepare_generation_config(None, **options)
        return config

    @property
    def _seer(self) -> bool:
        """Whether the model decodes with SeerAttention-R's sparse attention."""
        return self._model.config._attn_implementation == SEER_ATTENTION

    def _new_cache(self, capacity: int) -> DynamicCache | None:
        """A cache of `capacity` positions per row that appends in place; None for models whose
        cache is not plain full-attention keys and values (sliding windows, recurrent states), and
        where transformers lacks what the cache and the decode loop build on (`capabilities`)."""
        if not (capabilities.cache_layers() and capabilities.generation_internals()):
            return None
        # Here, after its probe: the module subclasses transformers' DynamicLayer.
        from .kv_cache import PreallocatedLayer, preallocated_cache

        share = self._model.config._attn_implementation == CASCADE_ATTENTION
        cache = preallocated_cache(self._model.config, capacity, share_repeats=share)
        if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            return None
        return cache

    def _prefill_shared_prefix(self, prefix: torch.Tensor, cache: DynamicCache, rows: int) -> None:
        """Fill `cache` with the keys and values of the [1, P] `prefix` every prompt of the batch
        starts with, repeated for the batch's `rows`: computed once for the batch (an MCTS
        batch's prompts share a few-shot preamble of hundreds of tokens), and only from where the
        model's stored prefixes stop (module `prefix_cache`)."""
        tokens = prefix[0].tolist()
        store = self.prefix_cache
        reused, stored = store.longest(tokens) if store is not None else (0, None)
        if stored is not None:
            for layer, (keys, values) in zip(cache.layers, stored, strict=True):
                layer.update(keys[:, :, :reused], values[:, :, :reused])
        if reused < len(tokens):
            decoder = self._model.get_decoder()
            decoder(
                input_ids=prefix[:, reused:],
                position_ids=torch.arange(reused, len(tokens), device=prefix.device)[None],
                **model_inputs(decoder, cache),
                use_cache=True,
            )
            if store is not None:
                store.put(
                    tokens, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
                )
        if store is not None:
            store.count(reused, len(tokens) - reused)
        cache.batch_repeat_interleave(rows)

    def _shared_prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache
    ) -> None:
        """Fill `cache` with the keys and values of every prompt token but the last (after what
        it holds already), computed once per prompt: n samples of a prompt then share one
        prefill (the cache is repeated per copy) instead of computing it n times."""
        start = cache.get_seq_length()
        if input_ids.shape[1] - start < 2:
            return
        mask = attention_mask[:, :-1]
        # The decoder alone: the prefill needs no logits.
        decoder = self._model.get_decoder()
        decoder(
            input_ids=input_ids[:, start:-1],
            attention_mask=mask,
            position_ids=first_positions(mask)[:, start:],
            **model_inputs(decoder, cache),
            use_cache=True,
        )
