"""SeerAttention-R kernels: block-sparse decode attention and its PyTorch references.

Triton and TileLang are imported only inside the backend modules' functions, so importing this
package loads torch alone.
"""

from __future__ import annotations

from .decode import BACKENDS, sparse_decode
from .reference import dense_decode_reference, sparse_decode_reference

__all__ = [
    "BACKENDS",
    "dense_decode_reference",
    "sparse_decode",
    "sparse_decode_reference",
]

# The SeerAttention-R gate and its self-distillation.
from .distill import (
    GateTrainConfig,
    distillation_target,
    gate_kl_loss,
    topk_recall,
    train_gates,
)
from .gate import (
    AttnGate,
    GateConfig,
    SeerGates,
    capture_pre_rope,
    gate_parameter_count,
    model_family,
)

__all__ += [
    "AttnGate",
    "GateConfig",
    "GateTrainConfig",
    "SeerGates",
    "capture_pre_rope",
    "distillation_target",
    "gate_kl_loss",
    "gate_parameter_count",
    "model_family",
    "topk_recall",
    "train_gates",
]
