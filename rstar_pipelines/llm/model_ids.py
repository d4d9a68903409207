"""The transformers backend's model ids, which key its cached completions, and the weights its
plain path runs. Torch-free: the Dagster resource names a model without loading it."""

from __future__ import annotations

from typing import Any

# Our code computes the transformers backend's completions as much as the model does. Bumped
# whenever a change to the backend changes them (its kernels, attention, decode loop, sampling), the
# revision is part of the backend's model ids, so that completions cached by older code are not
# served as this code's; ids before revision 2 carried none. 2: a prompt's prefill through the
# quantized layers' matmul (int4, int8); cascade attention on the CPU (float32's last bits). 3: int4
# decode steps of 4 to 47 rows through the AMX kernel (`cpu.kernels.quantized_cpu`); on a CPU
# without native bfloat16, the quantized layers' matmul in float32. 4: on a CPU without native
# bfloat16, int4 decode steps of 4-5 to 31-47 rows through the AVX-512 or AVX2 kernel
# (`cpu.kernels.quantized_cpu`). 5: on a CPU with AVX512-BF16 but no AMX, int4 decode steps of 5
# to 63 rows and int8 ones (the LM head) of 1 to 96 through the AVX-512 bfloat16 dot-product kernel
# (`cpu.kernels.quantized_cpu`). 6: a call's prompts batched by length (a prompt's padding and
# rows change); decode steps' attention through our kernel (`cpu.kernels.decode_attention_cpu`)
# on a CPU with AVX-512.
TRANSFORMERS_REVISION = 6
# What sets the plain path's completions apart (the CPU speed-ups off): transformers' generate().
PLAIN_TAG = "+plain"
# The switch of the CPU speed-ups, as a refusal names it.
CPU_SPEEDUPS_ENV = "RSTAR_LLM_CPU_SPEEDUPS"


def transformers_id(model: str, tag: str, seer: Any = None) -> str:
    """ "transformers@REVISION:" `model`, `tag` (what sets its weights or path apart) and the
    SeerAttention-R settings `seer`."""
    return f"transformers@{TRANSFORMERS_REVISION}:{model}{tag}" + (seer.tag if seer else "")


def plain_quantization(quantization: str | None) -> str:
    """ "none", the only weights the plain path runs; a clear error for any other scheme."""
    if quantization not in (None, "none"):
        raise ValueError(
            f"quantization={quantization!r} is one of the CPU speed-ups, which are switched off "
            f"(cpu_speedups=False or {CPU_SPEEDUPS_ENV}=off): use quantization='none'"
        )
    return "none"
