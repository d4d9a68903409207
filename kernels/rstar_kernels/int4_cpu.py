"""A weight-only int4 matmul for decode steps of several rows on CPUs with Intel AMX
(`int4_cpu.c`), built with the machine's C compiler on first use.

Why a kernel of our own: torch's `_weight_int4pack_mm_for_cpu` unpacks the weights again for
every few rows, so its cost grows with the rows (30 decoder layers of the embedded model, one
thread: 8 ms at 1 row, 45 at 16), and no library on PyPI has a faster one for this CPU (torchao's
DA8W4 kernel is not in its wheel and quantizes activations; docs/benchmarks.md). This one unpacks
each group of 32 weights once per call into a tile of small integers, multiplies up to 16 rows
with it in one AMX instruction and scales the float32 sums afterwards, so its cost barely grows
with the rows. Its results are float32 throughout and do not depend on the other rows.

The shared library is compiled from `int4_cpu.c` with gcc (or `$CC`) into the cache
(`$XDG_CACHE_HOME/rstar-pipelines/kernels`, named by a hash of the source and the flags) and
loaded with ctypes; OpenMP comes from the libgomp torch has loaded, so the kernel's threads are
torch's. `available()` is False, and callers keep torch's kernel, where the CPU lacks AMX, the
kernel cannot be granted its tile state, or there is no compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rstar_kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_cpu.c")
FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mamx-tile",
    "-mamx-bf16",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512f", "avx512bw"}
GROUP = 32  # inputs per scale and zero
BLOCK = 16  # outputs per tile


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rstar-pipelines" / "kernels"


def _build(compiler: str) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode())
    target = _cache_dir() / f"int4_cpu-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compiled beside the target and renamed onto it: processes building at once each
        # write their own file and the rename is atomic.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built)],
                check=True,
                capture_output=True,
                text=True,
            )
            built.replace(target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    missing = CPU_FLAGS - cpu_flags()
    if missing:
        log.info("int4 AMX kernel off: the CPU lacks %s", ", ".join(sorted(missing)))
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        log.warning("int4 AMX kernel off: no C compiler (gcc or $CC) to build it")
        return None
    try:
        path = _build(compiler)
    except subprocess.CalledProcessError as error:
        log.warning("int4 AMX kernel off: %s failed to build it:\n%s", compiler, error.stderr)
        return None
    library = ctypes.CDLL(str(path))
    if library.int4_cpu_init() != 0:
        log.warning("int4 AMX kernel off: Linux did not grant the process AMX's tile state")
        return None
    library.int4_cpu_mm.restype = ctypes.c_int
    library.int4_cpu_mm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return library


def available() -> bool:
    """Whether `mm` runs here (built and loaded on the first call)."""
    return _library() is not None


def pack(q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of `q` ([out, in] integers in 0..15; out a multiple of 16, in of 32):
    uint8 [out / 16, in / 32, 8, 32], two B-tile rows of a group in each byte's nibbles."""
    out_features, in_features = q.shape
    # Lane i of tile row j of (block, group): q[16 block + i // 2, 32 group + 2 j + i % 2].
    rows = (
        q.to(torch.uint8)
        .view(out_features // BLOCK, BLOCK, in_features // GROUP, GROUP // 2, 2)
        .permute(0, 2, 3, 1, 4)
        .reshape(out_features // BLOCK, in_features // GROUP, GROUP // 2, 2 * BLOCK)
    )
    return (rows[:, :, 0::2] | (rows[:, :, 1::2] << 4)).contiguous()


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """A per-group quantity ([out, in / 32]) in the kernel's layout: float32
    [out / 16, in / 32, 16]."""
    out_features, groups = values.shape
    return values.float().view(out_features // BLOCK, BLOCK, groups).transpose(1, 2).contiguous()


def mm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """float32 [rows, out] = `x` (bfloat16 [rows, in], contiguous) times the weights
    `(q - 8) * scale + zero` of `pack(q)`, `pack_groups(scale)`, `pack_groups(zero)`."""
    library = _library()
    if library is None:
        raise RuntimeError("the int4 AMX kernel is not available on this machine")
    rows, in_features = x.shape
    blocks, groups = packed.shape[:2]
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or in_features != groups * GROUP:
        raise ValueError(
            f"int4 AMX kernel: x must be contiguous bfloat16 [rows, {groups * GROUP}], "
            f"not {x.dtype} {tuple(x.shape)}"
        )
    out = torch.empty(rows, blocks * BLOCK)
    status = library.int4_cpu_mm(
        x.data_ptr(),
        rows,
        in_features,
        blocks * BLOCK,
        packed.data_ptr(),
        scale.data_ptr(),
        zero.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError(f"int4 AMX kernel: no memory for the scratch of {rows} rows")
    return out
