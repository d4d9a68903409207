"""vLLM's `vllm.general_plugins` entry point (pyproject: `rstar_seer`).

vLLM calls `register()` in every engine process before it builds the model. It points vLLM's
`CUSTOM` attention backend at `SeerSparseAttentionBackend` (`vllm_backend.py`), a FlashAttention
backend whose single-token decode steps read only the blocks that the SeerAttention-R gate
selects. Select it with `LLM(..., attention_backend="CUSTOM", block_size=<gate block size>,
enforce_eager=True)` and name the gate checkpoint in `RSTAR_GATE_CHECKPOINT` (the `vllm` LLM
backend of rstar_pipelines does all of this when given `sparse_attention="seer"`).

Written against vLLM 0.32.0's documented API (`vllm.v1.attention.backends.registry.
register_backend`, `AttentionBackendEnum.CUSTOM`) and NOT run: the machine it was written on has
no GPU and cannot install vLLM. What was run here: the paged decode path it calls
(`rstar_kernels.paged`) against the contiguous one, on the CPU.
"""

from __future__ import annotations

import warnings

PINNED_VLLM = "0.32.0"
BACKEND_CLASS = "rstar_kernels.vllm_backend.SeerSparseAttentionBackend"
# The settings vLLM's worker processes read from the environment they inherit.
GATE_ENV = "RSTAR_GATE_CHECKPOINT"
BUDGET_ENV = "RSTAR_SEER_TOKEN_BUDGET"
THRESHOLD_ENV = "RSTAR_SEER_THRESHOLD"
KERNEL_ENV = "RSTAR_SEER_KERNEL"


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
