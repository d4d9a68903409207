"""SeerAttention-R sparse decoding settings for the transformers backend (docs/seer-attention.md).

Only the settings live here, so the Dagster resource can validate them and name the model without
loading torch; `enable` hands them to `rstar_kernels.hf`, imported when a model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPARSE_METHODS = ("seer",)
# The paper's headline setting (docs/seer-attention.md), used when neither a budget nor a
# threshold is given.
DEFAULT_TOKEN_BUDGET = 4096
KERNEL_BACKENDS = ("torch", "triton", "tilelang")


@dataclass(frozen=True)
class SeerSettings:
    """Sparse decoding with the gates saved in `gate_checkpoint` (a `SeerGates.save` directory),
    keeping `token_budget` tokens per step or the blocks above `threshold`; `backend` is the
    `sparse_decode` kernel (None: chosen when the model is loaded)."""

    gate_checkpoint: str
    token_budget: int | None = None
    threshold: float | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.token_budget is not None and self.threshold is not None:
            raise ValueError("give token_budget or sparse_threshold for seer decoding, not both")
        if self.token_budget is None and self.threshold is None:
            object.__setattr__(self, "token_budget", DEFAULT_TOKEN_BUDGET)
        if self.token_budget is not None and (
            not isinstance(self.token_budget, int) or self.token_budget < 0
        ):
            raise ValueError(f"token_budget must be a non-negative int, got {self.token_budget!r}")
        if self.threshold is not None and not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"sparse_threshold must be in [0, 1), got {self.threshold!r}")
        if self.backend is not None and self.backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"sparse_backend must be one of {', '.join(KERNEL_BACKENDS)}, got {self.backend!r}"
            )
        path = Path(self.gate_checkpoint)
        if not (path / "gate_config.json").is_file():
            raise FileNotFoundError(
                f"gate_checkpoint {self.gate_checkpoint} is not a directory written by "
                "SeerGates.save (no gate_config.json in it)"
            )
        object.__setattr__(self, "gate_checkpoint", str(path.resolve()))

    @classmethod
    def from_options(
        cls,
        sparse_attention: str | None,
        gate_checkpoint: str | None,
        token_budget: int | None = None,
        threshold: float | None = None,
        backend: str | None = None,
    ) -> SeerSettings | None:
        """The settings, or None for dense decoding; a clear error for a half-given setup."""
        if sparse_attention is None:
            given = {
                "gate_checkpoint": gate_checkpoint,
                "token_budget": token_budget,
                "sparse_threshold": threshold,
            }
            stray = [name for name, value in given.items() if value is not None]
            if stray:
                raise ValueError(f"{', '.join(stray)} given without sparse_attention='seer'")
            return None
        if sparse_attention not in SPARSE_METHODS:
            raise ValueError(
                f"sparse_attention must be one of {', '.join(SPARSE_METHODS)} or None, "
                f"got {sparse_attention!r}"
            )
        if gate_checkpoint is None:
            raise ValueError(
                "sparse_attention='seer' needs gate_checkpoint: the directory of trained gates "
                "(SeerGates.save) for this model"
            )
        return cls(gate_checkpoint, token_budget, threshold, backend)

    def with_backend(self, backend: str) -> SeerSettings:
        return self if self.backend is not None else dataclasses.replace(self, backend=backend)

    @property
    def tag(self) -> str:
        """What sets these completions apart from dense ones (the kernel backend does not)."""
        keep = (
            f"budget={self.token_budget}"
            if self.token_budget is not None
            else f"threshold={self.threshold}"
        )
        return f"+seer({keep},gates={self.gate_checkpoint})"

    def enable(self, model: Any, source: str) -> None:
        """Load the gates onto `model`'s device and switch it to sparse decoding."""
        from rstar_kernels.gate import SeerGates
        from rstar_kernels.hf import enable_seer_decoding

        gates = SeerGates.load(self.gate_checkpoint, device=model.device)
        try:
            enable_seer_decoding(
                model,
                gates,
                token_budget=self.token_budget,
                threshold=self.threshold,
                backend=self.backend,
            )
        except ValueError as err:
            raise ValueError(f"gate_checkpoint {self.gate_checkpoint} for {source}: {err}") from err
