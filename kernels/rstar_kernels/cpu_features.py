"""What this machine's CPU computes natively, read from Linux's /proc/cpuinfo: the test that picks
the quantized layers' matmul dtype and what `mixed_precision: auto` trains in."""

from __future__ import annotations

import functools
from pathlib import Path

# Features with which oneDNN multiplies bfloat16 natively (AVX512-BF16's dot products, AMX's
# tiles). Without them its bfloat16 matmul emulates them and is several times slower than
# float32's, in inference and under bfloat16 autocast in training alike (docs/benchmarks.md).
BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def native_bfloat16() -> bool:
    """Whether the CPU multiplies bfloat16 natively."""
    return bool(BFLOAT16_FLAGS & cpu_flags())
