"""What the machine a job trains on has: its CUDA GPUs (through nvidia-smi, without importing
torch) and whether they, or without them the CPU, multiply bfloat16 natively; and the launch's
`mixed_precision: auto` resolved from that."""

from __future__ import annotations

import os
import subprocess

from rstar_pipelines.training.config import LaunchConfig

# bfloat16 tensor cores came with Ampere (compute capability 8.0); older GPUs emulate it.
BFLOAT16_COMPUTE_CAPABILITY = (8, 0)


def _nvidia_smi(*args: str) -> list[str]:
    """nvidia-smi's output lines for the GPUs visible here, or none (no driver, no GPU)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return lines
    chosen = visible.split(",")
    if all(index.strip().isdigit() for index in chosen):
        return [lines[int(index)] for index in chosen if int(index) < len(lines)]
    return lines[: len(chosen)]  # UUIDs: as many GPUs as are named


def cuda_devices() -> int:
    """GPUs visible to this machine's processes."""
    return sum(1 for line in _nvidia_smi("--list-gpus") if line.startswith("GPU "))


def cuda_compute_capabilities() -> list[tuple[int, int]]:
    """The compute capability of each visible GPU ((9, 0) for a Hopper)."""
    capabilities = []
    for line in _nvidia_smi("--query-gpu=compute_cap", "--format=csv,noheader"):
        major, _, minor = line.partition(".")
        if major.isdigit() and minor.isdigit():
            capabilities.append((int(major), int(minor)))
    return capabilities


def native_bfloat16() -> bool:
    """Whether the job's devices multiply bfloat16 natively: every visible GPU where there are
    any (they train), else the CPU."""
    capabilities = cuda_compute_capabilities()
    if capabilities:
        return all(c >= BFLOAT16_COMPUTE_CAPABILITY for c in capabilities)
    # Here, not at the top: the rstar_kernels package loads torch, which loading the pipeline's
    # definitions does not.
    from rstar_kernels import cpu_features

    return cpu_features.native_bfloat16()


def resolved(launch: LaunchConfig, job: str) -> LaunchConfig:
    """The launch with `mixed_precision: auto` made what this machine runs for `job`: bf16 where
    its devices multiply bfloat16 natively, else no (float32); no for the gate job, which
    distils in float32 only. Resolved before the job's fingerprint is taken, so checkpoints
    trained in either precision never share a job directory."""
    if launch.mixed_precision != "auto":
        return launch
    precision = "bf16" if job != "gate" and native_bfloat16() else "no"
    return launch.model_copy(update={"mixed_precision": precision})
