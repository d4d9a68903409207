"""The LLM layer: one interface, `LLM.generate(prompts, params)` and beside it
`types.submit`/`types.stream` (a future per prompt), over several backends.

- `transformers`: in-process, the CPU default; a Hugging Face directory, a .gguf file or "embedded".
- `openai`: OpenAI-compatible servers (vLLM, SGLang, `transformers serve`, llama.cpp), one or a
  fleet (docs/llm-serving.md).
- `vllm`: the in-process vLLM engine, on GPUs.

Importing this package loads none of torch, transformers or vllm; a backend imports them when built.
The Dagster resource is `rstar_pipelines.llm.resource.LLMResource`.
"""

from __future__ import annotations

from typing import Any

from .embedded import EmbeddedModelMissing, embedded_model_path, export_embedded_model
from .quantization import tag as quantization_tag
from .types import LLM, Completion, Prompt, SamplingParams, truncate_at_stop

BACKENDS = ("transformers", "openai", "vllm")

__all__ = [
    "BACKENDS",
    "LLM",
    "Completion",
    "EmbeddedModelMissing",
    "Prompt",
    "SamplingParams",
    "embedded_model_path",
    "export_embedded_model",
    "load_llm",
    "transformers_model_id",
    "truncate_at_stop",
]

# Our code computes the transformers backend's completions as much as the model does. Bumped
# whenever a change to the backend changes them (its kernels, attention, decode loop, sampling), the
# revision is part of the backend's model ids, so that completions cached by older code are not
# served as this code's; ids before revision 2 carried none. 2: a prompt's prefill through the
# quantized layers' matmul (int4, int8); cascade attention on the CPU (float32's last bits). 3: int4
# decode steps of 4 to 47 rows through the AMX kernel (`rstar_kernels.quantized_cpu`); on a CPU
# without native bfloat16, the quantized layers' matmul in float32. 4: on a CPU without native
# bfloat16, int4 decode steps of 4-5 to 31-47 rows through the AVX-512 or AVX2 kernel
# (`rstar_kernels.quantized_cpu`). 5: on a CPU with AVX512-BF16 but no AMX, int4 decode steps of 5
# to 63 rows and int8 ones (the LM head) of 1 to 96 through the AVX-512 bfloat16 dot-product kernel
# (`rstar_kernels.quantized_cpu`). 6: a call's prompts batched by length (a prompt's padding and
# rows change); decode steps' attention through our kernel (`rstar_kernels.decode_attention_cpu`)
# on a CPU with AVX-512.
TRANSFORMERS_REVISION = 6


def transformers_model_id(model: str, quantization: str, seer: Any = None) -> str:
    """The transformers backend's id for `model` under `quantization` and SeerAttention-R
    settings `seer`, which keys its cached completions: "transformers@6:embedded+int4"."""
    name = f"transformers@{TRANSFORMERS_REVISION}:{model}{quantization_tag(quantization)}"
    return name + (seer.tag if seer else "")


def load_llm(backend: str = "transformers", model: str | None = None, **options: Any) -> LLM:
    """Build an LLM.

    - transformers: `model` defaults to "embedded"; options batch_size, device, dtype,
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
        from .transformers_backend import TransformersLLM

        return TransformersLLM(model or "embedded", **options)
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
