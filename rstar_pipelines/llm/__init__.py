"""The LLM layer: one interface, `LLM.generate(prompts, params)` and beside it
`types.submit`/`types.stream` (a future per prompt), over several backends.

- `transformers`: in-process, the CPU default; a Hugging Face directory, a .gguf file or "embedded";
  with the CPU speed-ups (package `cpu`: quantized weights, C kernels, cascade attention, its own
  decode loop) unless `cpu_speedups` turns them off, which leaves transformers' plain `generate()`.
- `openai`: OpenAI-compatible servers (vLLM, SGLang, `transformers serve`, llama.cpp), one or a
  fleet (docs/llm-serving.md).
- `vllm`: the in-process vLLM engine, on GPUs.

Importing this package loads none of torch, transformers or vllm; a backend imports them when built.
The Dagster resource is `rstar_pipelines.llm.resource.LLMResource`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .cpu.quantization import resolve_quantization
from .cpu.quantization import tag as quantization_tag
from .embedded import EmbeddedModelMissing, embedded_model_path
from .model_ids import (
    CPU_SPEEDUPS_ENV,
    PLAIN_TAG,
    TRANSFORMERS_REVISION,
    plain_quantization,
    transformers_id,
)
from .types import LLM, Completion, Prompt, SamplingParams, truncate_at_stop

BACKENDS = ("transformers", "openai", "vllm")

__all__ = [
    "BACKENDS",
    "LLM",
    "TRANSFORMERS_REVISION",
    "Completion",
    "EmbeddedModelMissing",
    "Prompt",
    "SamplingParams",
    "cpu_speedups",
    "embedded_model_path",
    "export_embedded_model",
    "load_llm",
    "transformers_llm_class",
    "transformers_model_id",
    "transformers_quantization",
    "truncate_at_stop",
]


# The one switch of the CPU speed-ups (package `cpu`), CPU_SPEEDUPS_ENV: on unless it says off.
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def cpu_speedups(setting: bool | None = None) -> bool:
    """Whether the transformers backend runs with the CPU speed-ups (package `cpu`): `setting`,
    else RSTAR_LLM_CPU_SPEEDUPS (on unless "off", "false", "no" or "0")."""
    if setting is not None:
        return setting
    value = os.environ.get(CPU_SPEEDUPS_ENV, "").strip().lower()
    if value not in _OFF + _ON:
        raise ValueError(f"{CPU_SPEEDUPS_ENV} must be on or off, not {value!r}")
    return value not in _OFF


def transformers_llm_class(speedups: bool | None = None) -> Any:
    """The transformers backend's class: `cpu.backend.CpuTransformersLLM` with the CPU
    speed-ups (`cpu_speedups(speedups)`), else the plain `transformers_backend.TransformersLLM`.
    Both load (`load_model_and_tokenizer`), wrap a model in memory (`wrap`) and generate alike."""
    if cpu_speedups(speedups):
        from .cpu.backend import CpuTransformersLLM

        return CpuTransformersLLM
    from .transformers_backend import TransformersLLM

    return TransformersLLM


def transformers_quantization(
    quantization: str | None, model: str, device: str, speedups: bool | None = None
) -> str:
    """The scheme `model` loads with on `device` (`cpu.quantization.resolve_quantization`);
    "none" with the CPU speed-ups off, which refuse any other."""
    if cpu_speedups(speedups):
        return resolve_quantization(quantization, model, device)
    return plain_quantization(quantization)


def transformers_model_id(
    model: str, quantization: str, seer: Any = None, speedups: bool | None = None
) -> str:
    """The transformers backend's id for `model` under `quantization` and SeerAttention-R
    settings `seer`, which keys its cached completions: "transformers@6:embedded+int4", and
    "transformers@6:embedded+plain" with the CPU speed-ups off."""
    if cpu_speedups(speedups):
        return transformers_id(model, quantization_tag(quantization), seer)
    return transformers_id(model, PLAIN_TAG, seer)


def export_embedded_model(dest_dir: str | Path) -> Path:
    """Write the embedded model as a plain Hugging Face directory for servers
    (`transformers_backend.export_embedded_model`); returns `dest_dir`."""
    from .transformers_backend import export_embedded_model as export

    return export(dest_dir)


def load_llm(backend: str = "transformers", model: str | None = None, **options: Any) -> LLM:
    """Build an LLM.

    - transformers: `model` defaults to "embedded"; options cpu_speedups (default
      `cpu_speedups()`: on unless RSTAR_LLM_CPU_SPEEDUPS says off), batch_size, device, dtype,
      quantization ("none", "int8" or "int4"; default int4 on a CPU for the embedded model
      and the checkpoints trained from it), and for SeerAttention-R sparse decoding
      sparse_attention="seer", gate_checkpoint (a SeerGates.save directory), token_budget
      (default 4096) or sparse_threshold, sparse_backend ("torch", "triton", "tilelang";
      default "triton" on CUDA, else "torch").
    - openai: options base_url (required: one server, e.g. http://127.0.0.1:8000/v1, several
      comma-separated, or a list), api_key, max_concurrency (a cap on each server's window of
      sequences in flight), n_per_request, max_retries, timeout; `model` defaults to the first
      model the servers list.
    - vllm: `model` is required (a Hugging Face id or directory); options go to `vllm.LLM`.
    """
    if backend == "transformers":
        llm_class = transformers_llm_class(options.pop("cpu_speedups", None))
        return llm_class(model or "embedded", **options)
    if backend == "openai":
        from .openai_backend import OpenAILLM

        return OpenAILLM(model=model, **options)
    if backend == "vllm":
        from .vllm_backend import VllmLLM

        if model is None or model == "embedded":
            raise ValueError(
                "the vllm backend needs a Hugging Face model id or directory; to serve the "
                "embedded model, write one with export_embedded_model(dir) and pass that dir"
            )
        return VllmLLM(model, **options)
    raise ValueError(f"unknown LLM backend {backend!r}: expected one of {', '.join(BACKENDS)}")
