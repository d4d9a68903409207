"""One training process: `accelerate launch ... -m rstar_pipelines.training.run CONFIG.json`, which
`rstar_pipelines.training.launch` starts (and which checks the input first).

CONFIG.json holds `job` ("ppm", "sft", "gate" or "grpo"), `base_model` (the policy to start from:
"embedded", a .gguf file or a Hugging Face directory; a gate job keeps it frozen), `data` (a
Parquet file: preference pairs with prompt, chosen, rejected, pos_count, neg_count for "ppm"; chat
examples with `messages` for "sft"; texts for "gate": a `text` column, and optionally `messages`
for the rows whose text is null, rendered with the model's chat template; problems for "grpo":
id, domain, question, answer (math), inputs and labels (code), and `prompt`, the chat messages a
rollout starts from, already rendered from the prompt templates), `output_dir`, `train`
(PPMTrainConfig, SFTTrainConfig, GateTrainSettings or GRPOTrainConfig fields), `launch`
(LaunchConfig fields) and optionally `num_threads`. A grpo job starts a sandbox per process (the
backend and workers its config names) for the tool calls and the code rewards.

The ppm, sft and grpo jobs train with TRL; each saves resumable checkpoints under output_dir
(`checkpoint-<step>`) and resumes from the last complete one when started again. At the end the
first process writes the checkpoint (a Hugging Face directory; for "gate", a SeerGates
directory) and `training_metrics.json` to output_dir. Progress lines go to stdout, one per
logged step and rank (the launcher relays them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rstar_pipelines.agent.reward import AgentProblem
from rstar_pipelines.training import devices
from rstar_pipelines.training.config import LaunchConfig
from rstar_pipelines.training.gate import GateTrainSettings
from rstar_pipelines.training.grpo import GRPOTrainConfig
from rstar_pipelines.training.ppm import PPMTrainConfig
from rstar_pipelines.training.sft import SFTTrainConfig

COLUMNS = {
    "ppm": ("prompt", "chosen", "rejected", "pos_count", "neg_count"),
    "sft": ("messages",),
    "gate": ("text",),
    "grpo": ("id", "domain", "question", "answer", "inputs", "labels", "prompt"),
}
OPTIONAL_COLUMNS = {"gate": ("messages",)}
TRAIN_CONFIGS = {
    "ppm": PPMTrainConfig,
    "sft": SFTTrainConfig,
    "gate": GateTrainSettings,
    "grpo": GRPOTrainConfig,
}
TrainSettings = PPMTrainConfig | SFTTrainConfig | GateTrainSettings | GRPOTrainConfig
METRICS_FILE = "training_metrics.json"


class BadInput(Exception):
    """The config or the data cannot be used; the message says why."""


class RunConfig(BaseModel):
    """The contents of CONFIG.json."""

    model_config = ConfigDict(extra="forbid")

    job: Literal["ppm", "sft", "gate", "grpo"]
    base_model: str
    data: Path
    output_dir: Path
    train: dict[str, Any] = Field(default_factory=dict)
    launch: LaunchConfig = LaunchConfig()
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads per process")


def read_config(path: Path) -> tuple[RunConfig, TrainSettings]:
    if not path.is_file():
        raise BadInput(f"config file not found: {path}")
    try:
        config = RunConfig.model_validate_json(path.read_text())
        train = TRAIN_CONFIGS[config.job].model_validate(config.train)
    except ValidationError as error:
        raise BadInput(f"invalid config {path}: {error}") from error
    # The launcher and every rank resolve `auto` on this machine, to the same precision.
    return config.model_copy(update={"launch": devices.resolved(config.launch, config.job)}), train


def read_rows(config: RunConfig) -> list[dict]:
    """The data rows, only the columns the job uses."""
    if not config.data.is_file():
        raise BadInput(f"data file not found: {config.data}")
    try:
        names = pq.read_schema(config.data).names
    except pa.ArrowInvalid as error:
        raise BadInput(f"{config.data} is not a Parquet file: {error}") from error
    missing = [column for column in COLUMNS[config.job] if column not in names]
    if missing:
        raise BadInput(
            f"{config.data} lacks the column(s) {', '.join(missing)} that a {config.job} job "
            f"needs (it has {', '.join(names)})"
        )
    optional = [c for c in OPTIONAL_COLUMNS.get(config.job, ()) if c in names]
    rows = pq.read_table(config.data, columns=[*COLUMNS[config.job], *optional]).to_pylist()
    if not rows:
        raise BadInput(f"{config.data} has no rows")
    if config.job == "gate":
        empty = [i for i, r in enumerate(rows) if r["text"] is None and not r.get("messages")]
        if empty:
            raise BadInput(f"{config.data}: rows {empty[:10]} have neither text nor messages")
    if config.job == "grpo":
        agent_problems(rows, config.data)
    return rows


def agent_problems(rows: list[dict], source: Path) -> tuple[list[AgentProblem], list[list[dict]]]:
    """The problems of a grpo job's rows and the prompt each rollout starts from."""
    problems, prompts = [], []
    for number, row in enumerate(rows):
        prompt = row["prompt"] or []
        if not prompt or not isinstance(prompt[-1], dict) or prompt[-1].get("role") != "user":
            raise BadInput(f"{source} row {number}: prompt must be chat messages ending with user")
        try:
            problems.append(
                AgentProblem(
                    id=row["id"],
                    domain=row["domain"],
                    question=row["question"],
                    answer=row["answer"],
                    inputs=tuple(row["inputs"] or ()),
                    labels=tuple(row["labels"] or ()),
                )
            )
        except ValueError as error:
            raise BadInput(f"{source} row {number}: {error}") from error
        prompts.append([{"role": m["role"], "content": m["content"]} for m in prompt])
    return problems, prompts


def train(
    config: RunConfig,
    train_config: TrainSettings,
    rows: list[dict],
    log: Callable[[str], Any],
) -> dict:
    """Train, save the checkpoint to output_dir and return the metrics."""
    import torch

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(train_config.seed)  # the PPM's head and the gates are drawn at random
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"loading {config.base_model} for a {config.job} job on {device}")
    out, launch = config.output_dir, config.launch
    if config.job == "gate":
        from rstar_pipelines.training.gate import train_gate_job

        return train_gate_job(config.base_model, device, out, train_config, rows, log)
    if config.job == "ppm":
        from rstar_pipelines.training.ppm import ppm_from_base, train_ppm

        ppm = ppm_from_base(config.base_model)
        return train_ppm(ppm, rows, train_config, log, output_dir=out, launch=launch)
    from rstar_pipelines.training.base_models import add_tags, load_trainable

    model, tokenizer = load_trainable(config.base_model)
    if config.job == "sft":
        from rstar_pipelines.training.sft import train_sft

        add_tags(model, tokenizer)
        return train_sft(model, tokenizer, rows, train_config, log, output_dir=out, launch=launch)
    return _train_grpo(model, tokenizer, rows, config, train_config, log)


def _train_grpo(
    model: Any,
    tokenizer: Any,
    rows: list[dict],
    config: RunConfig,
    train_config: GRPOTrainConfig,
    log: Callable[[str], Any],
) -> dict:
    from rstar_pipelines.training.grpo import train_grpo
    from rstar_sandbox import Sandbox

    problems, prompts = agent_problems(rows, config.data)
    log(f"starting a {train_config.sandbox_backend} sandbox for the tool calls and rewards")
    with Sandbox(
        backend=train_config.sandbox_backend, workers=train_config.sandbox_workers
    ) as sandbox:
        return train_grpo(
            model,
            tokenizer,
            problems,
            train_config,
            sandbox,
            prompts,
            log,
            output_dir=config.output_dir,
            launch=config.launch,
        )


def run(config_path: Path, log: Callable[[str], Any]) -> None:
    config, train_config = read_config(config_path)
    rows = read_rows(config)
    started = time.monotonic()
    metrics = train(config, train_config, rows, log)
    if _rank()[0] == 0:
        import torch

        record = {
            "job": config.job,
            "base_model": config.base_model,
            "train": train_config.model_dump(),
            "launch": config.launch.model_dump(),
            # This process's time on the job (loading, training, saving) unless the job says.
            "seconds": round(time.monotonic() - started, 3),
            "cpu_threads": torch.get_num_threads(),  # torch's, in each process
            **metrics,
        }
        (config.output_dir / METRICS_FILE).write_text(json.dumps(record, indent=2) + "\n")
        log(f"saved the checkpoint to {config.output_dir}")


def _rank() -> tuple[int, int]:
    """(this process's rank, the number of processes), as torchrun / accelerate set them."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _logger() -> Callable[[str], Any]:
    """Progress lines to stdout, prefixed with the rank when there are several processes."""
    rank, world = _rank()
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    return lambda message: print(prefix + message, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rstar_pipelines.training.run CONFIG.json", file=sys.stderr)
        return 2
    import datasets
    import transformers

    # The progress lines say how far it is; bars from every rank would only interleave.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        run(Path(args[0]), _logger())
    except BadInput as error:
        print(f"training: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
