"""The declared settings of a training job: the recipe (`TrainConfig`, one subclass per job) and
how it runs (`LaunchConfig`: processes, mixed precision, a DeepSpeed / FSDP configuration, gradient
accumulation, LoRA, checkpoints). Plain pydantic: pipeline.yaml is checked when it loads, without
importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Accelerate configuration files that TRL ships (trl/accelerate_configs/<name>.yaml).
TRL_ACCELERATE_CONFIGS = ("zero1", "zero2", "zero3", "fsdp1", "fsdp2", "multi_gpu", "single_gpu")


class TrainConfig(BaseModel):
    """Settings every TRL job has. Defaults follow the reference where it has one
    (docs/training.md); `batch_size` is per process, so the effective batch is batch_size *
    processes * gradient_accumulation_steps (the reference's 512 pairs: 16 * 8 GPUs * 4)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(7e-6, gt=0, description="peak learning rate, decayed linearly to 0")
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(8, ge=1, description="examples per process and micro-batch")
    max_length: int = Field(2048, ge=2, description="most tokens per sequence")
    seed: int = Field(0, ge=0, description="torch, the batch order, the held-out split")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the gradient norm (the HF Trainer default); None: no clipping"
    )


class LoraSettings(BaseModel):
    """A LoRA adapter (peft) trained instead of the full weights; merged into them when training
    ends, so the checkpoint is a plain model directory."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="the adapter's rank")
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: str | list[str] = Field(
        "all-linear", description="module names, or peft's 'all-linear'"
    )


class LaunchConfig(BaseModel):
    """How a job runs: what `accelerate launch` starts and what the Trainer does around the recipe.

    Without a GPU the processes are CPU processes joined over gloo; with GPUs, one per GPU. An
    `accelerate_config` (one of TRL's files by name, e.g. "zero3" or "fsdp2", or a path; relative
    paths are under the data directory) brings DeepSpeed ZeRO, FSDP or several machines; the
    fields here override what it says about processes and mixed precision.
    """

    model_config = ConfigDict(extra="forbid")

    processes: int = Field(1, ge=1, description="processes on this machine (one per GPU)")
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = Field(
        "no",
        description="autocast with float32 master weights; fp16 needs a GPU; auto: bf16 where "
        "the machine's GPUs (compute capability 8.0 or newer) or, without GPUs, its CPU "
        "(AVX512-BF16 or AMX) multiply bfloat16 natively, else no (the gate job: no)",
    )
    accelerate_config: str | None = Field(
        None, description=f"an accelerate config file, or one of TRL's: {TRL_ACCELERATE_CONFIGS}"
    )
    gradient_accumulation_steps: int = Field(1, ge=1)
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, slower"
    )
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter (peft) instead")
    save_steps: int | None = Field(
        500,
        ge=1,
        description="save a resumable checkpoint every this many optimizer steps; None: only the "
        "final model (a killed job then starts over)",
    )
    save_total_limit: int = Field(
        1, ge=1, description="resumable checkpoints kept; they are removed when training ends"
    )

    @model_validator(mode="after")
    def _named_config(self) -> LaunchConfig:
        name = self.accelerate_config
        is_path = name is not None and ("/" in name or name.endswith((".yaml", ".yml", ".json")))
        if name is not None and not is_path and name not in TRL_ACCELERATE_CONFIGS:
            raise ValueError(
                f"accelerate_config {name!r} is neither a file (a path ending in .yaml, .yml "
                f"or .json) nor one of TRL's configs: {', '.join(TRL_ACCELERATE_CONFIGS)}"
            )
        return self
