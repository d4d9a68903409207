"""What the TRL jobs share around transformers' Trainer: their arguments from the declared settings,
progress lines, resuming from the last complete checkpoint, the final model and the figures.

Every function here runs inside a training process (one per rank under `accelerate launch`, or the
caller's own process); torch, transformers and TRL are imported when one is called.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rstar_pipelines.training.config import LaunchConfig, TrainConfig

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# Written last into a checkpoint (after the weights, optimizer and RNG states): a checkpoint
# without it was cut off by a kill and is not resumed from.
TRAINER_STATE = "trainer_state.json"


def arguments(
    config_class: type,
    train: TrainConfig,
    launch: LaunchConfig,
    output_dir: Path,
    **job: Any,
) -> Any:
    """The TRL config (`config_class`, e.g. trl.SFTConfig) of a job: the shared settings from
    `train` and `launch`, then the job's own (`job`), which may override them.

    A step is logged every optimizer step (the loss curve), nothing is reported anywhere else, and
    TRL's own defaults that would change the recipe (bf16 and gradient checkpointing on) are set
    from the launch configuration instead."""
    import dataclasses

    import torch

    # transformers renamed gradient checkpointing (the old name warns); older releases lack the new.
    fields = {f.name for f in dataclasses.fields(config_class)}
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "learning_rate": train.lr,
        "num_train_epochs": train.epochs,
        "max_steps": train.max_steps or -1,
        "per_device_train_batch_size": train.batch_size,
        "per_device_eval_batch_size": train.batch_size,
        "gradient_accumulation_steps": launch.gradient_accumulation_steps,
        "max_grad_norm": train.max_grad_norm or 0.0,
        "seed": train.seed,
        "data_seed": train.seed,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "logging_steps": 1,
        "save_strategy": "steps" if launch.save_steps else "no",
        "save_steps": launch.save_steps or 500,
        "save_total_limit": launch.save_total_limit,
        "report_to": [],
        "disable_tqdm": True,
        "log_level": "warning",
        "bf16": launch.mixed_precision == "bf16",
        "fp16": launch.mixed_precision == "fp16",
        checkpointing: launch.gradient_checkpointing,
        "use_cpu": not torch.cuda.is_available(),
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
    }
    return config_class(**{**settings, **job})


def peft_config(launch: LaunchConfig, task_type: str, modules_to_save: list[str] | None = None):
    """peft's LoraConfig for `launch.lora`, or None without one."""
    if launch.lora is None:
        return None
    from peft import LoraConfig

    lora = launch.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task_type,
        modules_to_save=modules_to_save,
    )


def last_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint under output_dir (`checkpoint-<step>` with its trainer
    state), or None: where a killed job resumes."""
    if not output_dir.is_dir():
        return None
    found = [
        (int(match.group(1)), path)
        for path in output_dir.iterdir()
        if (match := CHECKPOINT_DIR.match(path.name)) and (path / TRAINER_STATE).is_file()
    ]
    return max(found)[1] if found else None


def callbacks(job: str, log: Callable[[str], Any]) -> list[Any]:
    """The TrainerCallbacks of every job: a line logged per logged step and one per evaluation,
    on every process (the job's log function says which); and no resumable checkpoint after the
    last step. transformers saves one there (the weights, and the optimizer's state, twice
    their size), which `finish` deletes once it has written the model: on the CPU writing it
    can take longer than a small job's training steps."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            figures = ", ".join(
                f"{key} {value:.4g}" for key, value in (logs or {}).items() if _shown(key, value)
            )
            log(f"{job} step {state.global_step}/{state.max_steps}: {figures}")

    class NoCheckpointAtTheEnd(TrainerCallback):
        # Runs after transformers' DefaultFlowCallback, which asks for that save.
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_save = False

    return [Progress(), NoCheckpointAtTheEnd()]


# Logged figures the progress lines leave out: bookkeeping, and TRL's per-completion statistics.
_UNSHOWN = re.compile(
    r"epoch|flos|num_tokens|runtime|per_second|preparation_time|^completions/|^rewards/"
)


def _shown(key: str, value: Any) -> bool:
    return isinstance(value, int | float) and not _UNSHOWN.search(key)


def train(trainer: Any, output_dir: Path, log: Callable[[str], Any]) -> int | None:
    """Run `trainer` from the last complete checkpoint under output_dir, if there is one; returns
    the step it resumed from (None: started fresh)."""
    checkpoint = last_checkpoint(output_dir)
    resumed = None
    if checkpoint is not None:
        resumed = int(CHECKPOINT_DIR.match(checkpoint.name).group(1))
        log(f"resuming from {checkpoint.name}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    return resumed


def finish(trainer: Any, tokenizer: Any, output_dir: Path | None) -> Any:
    """Merge a LoRA adapter into the trained model's weights; with an output_dir, write the model
    and tokenizer there as a plain Hugging Face directory and remove the resumable checkpoints.
    Returns the trained model (the caller's, with a LoRA adapter merged into it)."""
    from accelerate.utils import is_peft_model

    model = trainer.accelerator.unwrap_model(trainer.model)
    trainer.accelerator.wait_for_everyone()
    if is_peft_model(model):
        model = model.merge_and_unload()
        if output_dir is not None and trainer.is_world_process_zero():
            model.save_pretrained(output_dir)
    elif output_dir is not None:
        trainer.save_model(str(output_dir))  # every rank: DeepSpeed / FSDP gather the weights
    if output_dir is not None and trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)
        for path in output_dir.iterdir():
            if CHECKPOINT_DIR.match(path.name):
                shutil.rmtree(path)
    trainer.accelerator.wait_for_everyone()
    return model


def logged(trainer: Any, key: str) -> list[float]:
    """Every logged value of `key` in step order (the resumed part of the run included: the
    history comes back with the checkpoint)."""
    return [entry[key] for entry in trainer.state.log_history if key in entry]
