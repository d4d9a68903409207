"""vLLM's `vllm.general_plugins` entry point (pyproject: `rstar_seer`) and the settings that
vLLM's worker processes read from the environment they inherit.

vLLM calls `register()` in every engine process before it builds the model (if `VLLM_PLUGINS`
is set, it must name `rstar_seer`: `vllm/plugins/__init__.py`, `load_plugins_by_group`). It
points vLLM's `CUSTOM` attention backend at `SeerSparseAttentionBackend` (`vllm_backend.py`).
Select it with `LLM(..., attention_backend="CUSTOM", block_size=<gate block size>)` or
`vllm serve ... --attention-backend CUSTOM`; `rstar serve` and the `vllm` LLM backend of
rstar_pipelines set all of it up.

The settings (`SEER_ENV`): RSTAR_GATE_CHECKPOINT (a `SeerGates` directory; required),
RSTAR_SEER_TOKEN_BUDGET or RSTAR_SEER_THRESHOLD (default: a 4,096-token budget, the paper's
near-lossless setting) and RSTAR_SEER_KERNEL (`triton`, the default, or `tilelang`).

Written against vLLM 0.32.0 (`vllm.v1.attention.backends.registry.register_backend`,
`AttentionBackendEnum.CUSTOM`) and NOT run: no machine this was written on could install vLLM.
What runs here: everything but the registration and the backend's shell, on the CPU
(`vllm_layout`, `paged`, and `settings_from_env`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

from .gate import CONFIG_FILE, GateConfig
from .vllm_layout import Selection

PINNED_VLLM = "0.32.0"
PLUGIN_NAME = "rstar_seer"
BACKEND_CLASS = "rstar_kernels.vllm_backend.SeerSparseAttentionBackend"
GATE_ENV = "RSTAR_GATE_CHECKPOINT"
BUDGET_ENV = "RSTAR_SEER_TOKEN_BUDGET"
THRESHOLD_ENV = "RSTAR_SEER_THRESHOLD"
KERNEL_ENV = "RSTAR_SEER_KERNEL"
SEER_ENV = (GATE_ENV, BUDGET_ENV, THRESHOLD_ENV, KERNEL_ENV)
DEFAULT_TOKEN_BUDGET = 4096
VLLM_KERNELS = ("triton", "tilelang")


def register() -> None:
    """Register the sparse decode backend as vLLM's CUSTOM attention backend (re-entrant)."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if vllm.__version__ != PINNED_VLLM:
        warnings.warn(
            f"rstar_kernels' SeerAttention-R backend is written for vLLM {PINNED_VLLM}; this is "
            f"vLLM {vllm.__version__}, whose attention-backend interface may differ",
            stacklevel=2,
        )
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)


def load_gate_config(directory: str | Path) -> GateConfig:
    """The config of a `SeerGates.save` directory, without loading the weights."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}: not a SeerGates directory")
    try:
        return GateConfig(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not a valid gate config: {err}") from err


def settings_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, Selection]:
    """The gate checkpoint and the selection rule a worker reads; a clear error naming the
    variable that is missing or wrong."""
    path = environ.get(GATE_ENV)
    if not path:
        raise RuntimeError(f"the SeerAttention-R vLLM backend needs {GATE_ENV} (a gate checkpoint)")
    budget, threshold = environ.get(BUDGET_ENV), environ.get(THRESHOLD_ENV)
    if budget and threshold:
        raise ValueError(f"set {BUDGET_ENV} or {THRESHOLD_ENV}, not both")
    kernel = environ.get(KERNEL_ENV) or "triton"
    if kernel not in VLLM_KERNELS:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(VLLM_KERNELS)}, not {kernel!r}")
    try:
        selection = Selection(
            token_budget=None if threshold else int(budget or DEFAULT_TOKEN_BUDGET),
            threshold=float(threshold) if threshold else None,
            kernel=kernel,
        )
    except ValueError as err:
        name = THRESHOLD_ENV if threshold else BUDGET_ENV
        raise ValueError(f"{name}={environ.get(name)!r}: {err}") from err
    return path, selection
