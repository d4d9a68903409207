"""Quantized weights for the transformers backend on a CPU (docs/benchmarks.md, "Embedded
generation").

- "none": the weights as loaded (float32 for the embedded GGUF model, which transformers
  dequantizes on load).
- "int8": every linear layer, the LM head included, as int8 weights (one scale per output row)
  with int8 activations quantized on the fly; the matrix products run in FBGEMM through torch's
  dynamic quantization (`torch.ao.nn.quantized.dynamic.Linear`). Decoding is memory-bound on a
  CPU, so a quarter of the bytes per step is most of the gain.

Why torch's own dynamic quantization and not torchao: on this x86 CPU (torch 2.13, torchao 0.18
from PyPI) torchao's eager CPU paths are slower than float32 (its int8 weight-only linear
dequantizes the whole weight every call, the int4 and int8 CPU kernels it calls are 10-100x
slower than float32 at 16 rows, and its DA8W4 CPU kernel is not in the PyPI wheel); torch's
FBGEMM path is 3-10x faster than float32 per layer. pytorch/ao#4365 reports the same. torch marks
`torch.ao.quantization` deprecated, so `quantize` fails with a clear error if it is gone.

What changes with "int8": activations are quantized per call with one scale for the whole input,
so a row's logits depend slightly on the other rows in its batch; completions stay reproducible
for the same prompts, params and batch_size. Quality against float32 is in docs/benchmarks.md.

Settings only need no torch: the Dagster resource validates and names them without loading it.
"""

from __future__ import annotations

import warnings
from typing import Any

QUANTIZATIONS = ("none", "int8")


def default_device(device: str | None) -> str:
    """The device a model loads on: the one given, else CUDA where there is one, else the CPU."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_quantization(quantization: str | None, model: str, device: str) -> str:
    """The scheme a model loads with: the one given, else "int8" for the embedded model on a
    CPU and "none" otherwise; a clear error for a scheme that does not exist or cannot run."""
    if quantization is None:
        return "int8" if model == "embedded" and device == "cpu" else "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if quantization != "none" and device != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU (FBGEMM); {model} is on {device}: "
            "use quantization='none' there (or the vllm backend's own quantization)"
        )
    return quantization


def tag(quantization: str) -> str:
    """What sets a scheme's completions apart in a model id: "" for none, "+int8" for int8."""
    return "" if quantization == "none" else f"+{quantization}"


def quantize(model: Any, quantization: str) -> Any:
    """`model` with its linear layers quantized in place (and returned); "none" leaves it as is."""
    if quantization == "none":
        return model
    import torch

    if model.dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} needs a float32 model (FBGEMM takes float32 "
            f"activations); this one is {model.dtype}: load it with dtype='float32'"
        )
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as err:
        raise RuntimeError(
            f"quantization={quantization!r} needs torch.ao.quantization (dynamic int8 linear "
            f"layers), which this torch {torch.__version__} no longer has; use "
            "quantization='none'"
        ) from err
    # torch warns on every call that torch.ao.quantization is deprecated in favour of torchao;
    # see the module docstring for why this path is kept.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return quantize_dynamic(
            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )
