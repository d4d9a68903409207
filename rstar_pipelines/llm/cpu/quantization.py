"""Quantized weights for the transformers backend on a CPU (docs/benchmarks.md, "Quantized
kernels" and "Embedded model quality").

- "none": the weights as loaded (float32 for the embedded GGUF model, which transformers
  dequantizes on load).
- "int8": every linear layer, the LM head included, keeps its weight as int8 with one scale per
  output row (symmetric, absmax / 127) and runs through torch's weight-only int8 matmul,
  `aten._weight_int8pack_mm` (the kernel Inductor lowers weight-only int8 linears to), on bfloat16
  activations with a float32 result; from 8 rows on, and for a prompt's prefill, through a matmul
  over the same integers (bfloat16 where the CPU multiplies it natively, else float32), which that
  row-by-row kernel cannot match for many rows (module `quantized_linear`). Decoding few rows is
  memory-bound on a CPU: a quarter of the weight bytes per step is most of the gain. Activations are
  not quantized, so under one kernel a row's result does not depend on the other rows of its batch.
- "int4" (the default for the embedded model and its checkpoints on a CPU): the decoder layers'
  linear layers keep 4-bit weights in groups of 32 inputs with a scale and a zero each, the layout
  the embedded GGUF file ships them in (Q4_1), so the groups land back on the file's grid (up to the
  bfloat16 rounding of each scale and zero); torch's `aten._weight_int4pack_mm_for_cpu` runs them
  for few rows, a kernel of ours (`kernels.quantized_cpu`, where one runs) from 4-5 rows, the
  matmul from `INT4_KERNEL_ROWS`' second figure (32 where none of ours runs) and for a prompt's
  prefill. The LM head, which the file keeps in 8 bits (Q8_0, tied to the embeddings), and any layer
  whose shape the int4 kernel does not take, are int8 as above. Half the bytes of int8 per step, and
  closer to float32 on the embedded model (teacher-forced KL 0.0017 against int8's 0.0034). A
  checkpoint trained from the embedded model keeps the embedded model's grid (`quantize`'s `grid`):
  its weights round to the base's groups, so what training left alone decodes exactly as the base
  does and only weights an update moved by half a step change. Fitted afresh, every group whose
  minimum or maximum moved would land on a new grid: after the demo's one SFT step that changed the
  decoded value of 6.7% of the decoder weights, by 68 times the norm of the update itself (int8,
  whose rows are fitted afresh: 0.2% of the weights, 21 times), so that comparing a checkpoint with
  its base would have measured the rounding.

Why this kernel (measured with torch 2.13 and torchao 0.18 from PyPI; docs/benchmarks.md):
- torch's dynamic int8 quantization (FBGEMM, `torch.ao.quantization.quantize_dynamic`) is the
  fastest, but it quantizes activations with one scale per call: the embedded model's massive
  activations (inputs to down_proj reach about 3300) and left padding set that scale, and
  teacher-forced KL against float32 was 1.5 per token (top-1 agreement 0.57); one scale per row
  still gave 0.20 (0.83). Weight-only int8 gives 0.006 (0.97).
- torchao's eager CPU paths were slower than float32: its int8 weight-only linear
  dequantizes the whole weight on every call, its dynamic int8 path likewise (pytorch/ao#4365),
  its int4 CPU path runs a kernel 10-100x slower than float32 at 16 rows, and its DA8W4 kernel
  is not in the PyPI wheel.
- `_weight_int8pack_mm` is fast only with bfloat16 (or CUDA) activations: its float32 and
  float16 CPU paths are unvectorized, hence the cast. So is `_weight_int4pack_mm_for_cpu`'s,
  which torchao's int4 CPU layout calls: with float32 activations it is over twenty times slower
  than with bfloat16 ones.

Settings need no torch: the Dagster resource validates and names them without loading it.
"""

from __future__ import annotations

from typing import Any

from ..embedded import trained_from_embedded

QUANTIZATIONS = ("none", "int8", "int4")
# The scheme of the embedded model and the checkpoints trained from it on a CPU.
EMBEDDED_QUANTIZATION = "int4"


def resolve_quantization(quantization: str | None, model: str, device: str) -> str:
    """The scheme a model loads with: the one given, else `EMBEDDED_QUANTIZATION` on a CPU for
    the embedded model and the checkpoints trained from it (so an evaluation compares them
    decoded alike), "none" otherwise; a clear error for a scheme that does not exist or cannot
    run."""
    if quantization is None:
        if device == "cpu" and trained_from_embedded(model):
            return EMBEDDED_QUANTIZATION
        return "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if quantization != "none" and device != "cpu":
        raise ValueError(
            f"quantization={quantization!r} is for the CPU; {model} is on {device}: use "
            "quantization='none' there (or a serving engine's own quantization)"
        )
    return quantization


def tag(quantization: str) -> str:
    """What sets a scheme's completions apart in a model id: "" for none, "+int8" for int8,
    and so on."""
    return "" if quantization == "none" else f"+{quantization}"


def quantize(model: Any, quantization: str, grid: Any = None) -> Any:
    """`model` with its linear layers replaced in place (and returned); "none" leaves it as is.
    With "int4" and `grid`, a model `model` was trained from, quantized "int4" too: each int4
    layer keeps the grid of its namesake there (module docstring)."""
    if quantization == "none":
        return model
    import torch

    if model.dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} takes a float32 model, this one is {model.dtype}: "
            "load it with dtype='float32'"
        )
    from .quantized_linear import Int4Linear, Int8Linear

    head = model.get_output_embeddings()
    grids = {}
    if grid is not None:
        grids = {
            name: layer.scales_and_zeros
            for name, layer in grid.named_modules()
            if isinstance(layer, Int4Linear)
        }
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            if quantization == "int4" and child is not head and Int4Linear.fits(child):
                # A grid of another shape is refused by the layer (training resizes only the
                # embeddings and the LM head, which are not int4).
                layer_grid = grids.get(f"{prefix}.{name}" if prefix else name)
                setattr(parent, name, Int4Linear(child, layer_grid))
            else:
                setattr(parent, name, Int8Linear(child))
    return model
