"""The gate job of the training process: SeerAttention-R gates distilled from a frozen base model
(docs/seer-attention.md). The method lives in `rstar_kernels.distill`, imported only when a job
runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rstar_pipelines.llm import transformers_llm_class


class GateTrainSettings(BaseModel):
    """The declared form of `rstar_kernels.distill.GateTrainConfig` (same fields and defaults),
    so pipeline.yaml is checked when it loads, without importing torch."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, description="peak learning rate (reference: 1e-3)")
    min_lr: float = Field(1e-5, gt=0, description="the cosine decay's floor")
    warmup_steps: int = Field(20, ge=0)
    steps: int = Field(800, ge=1, description="optimizer steps, one text each")
    max_length: int = Field(4096, ge=2, description="tokens per text; longer ones are cut")
    block_size: int = Field(64, ge=1, description="tokens per key block (reference: 64)")
    gate_dim: int = Field(128, ge=2, description="gate query/key dims (reference: 128)")
    qk_norm: bool = True
    loss_slice_ratio: float = Field(
        0.5, ge=0, lt=1, description="rows before this fraction of a text do not count"
    )
    gate_loss_scale: float = Field(10.0, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    heldout_fraction: float = Field(0.1, ge=0, lt=1)
    topk_blocks: int = Field(4, ge=1, description="the budget, in blocks, of the held-out recall")
    cache_teacher: bool = Field(
        False, description="keep each text's frozen-model pass in memory after its first use"
    )
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _blocks_fit(self) -> GateTrainSettings:
        if self.max_length <= self.block_size:
            raise ValueError("max_length must exceed block_size: no row would have a target")
        return self


def row_text(row: dict, tokenizer: Any) -> str:
    """A data row's text: its `text`, else its chat `messages` in the model's chat template."""
    if row.get("text") is not None:
        return row["text"]
    return tokenizer.apply_chat_template(row["messages"], tokenize=False)


def train_gate_job(
    base_model: str,
    device: str,
    output_dir: Path,
    settings: GateTrainSettings,
    rows: list[dict],
    log: Callable[[str], Any],
) -> dict:
    """Train gates for the frozen `base_model` on the rows' texts, save them to output_dir
    (`SeerGates.load` reads it) and return the metrics."""
    from rstar_kernels.distill import GateTrainConfig, train_gates

    load = transformers_llm_class().load_model_and_tokenizer
    model, tokenizer = load(base_model, device=device)
    texts = [row_text(row, tokenizer) for row in rows]
    config = GateTrainConfig(**settings.model_dump())
    # The base model as declared, not the loader's resolved path.
    gates, metrics = train_gates(model, tokenizer, texts, config, log, base_model=base_model)
    gates.save(output_dir)
    return metrics
