"""GRPO-RoC: rStar2-Agent's agentic RL of the policy (docs/agent.md) on `trl.GRPOTrainer`.

TRL runs the loop (batches, generation buffer, optimizer, accelerate, checkpoints); the
algorithm's pieces come from `rstar_pipelines.agent` through two hooks of a GRPOTrainer subclass:

- the rollout function (TRL's `rollout_func`): each process gets whole groups, `group_size`
  copies of a problem's prompt each (the batch settings are checked to make it so). Per group it
  samples `oversample * group_size` multi-turn rollouts with the policy as it is now, the Python
  tool running in this process's sandbox (`agent.rollout.run_rollouts`, through transformers, or
  vLLM in TRL's colocate mode on a GPU); scores them with the binary outcome reward
  (`agent.reward.rewards`); keeps `group_size` of them with Resample-on-Correct
  (`agent.roc.resample_on_correct`) and gives the kept ones their GRPO advantages
  (`agent.grpo.group_advantages`). A group whose rewards are all equal is dropped: its first
  `group_size` rollouts fill its place with an all-zero loss mask (TRL's batch shape is fixed), so
  they weigh nothing, and an optimizer step whose groups were all dropped makes no update (its
  gradients are discarded before the optimizer sees them; on one process such a micro-batch's
  loss is a zero that skips the model's forward and backward). Each rollout becomes prompt ids,
  completion ids and a mask: 1 on each assistant turn and the template's end-of-turn after it, 0
  on the tool-response turns and the markup between turns (`sft.chat_tokens`, as SFT renders).
- the loss (`compute_loss`): `agent.grpo.grpo_loss`, the PPO clipped loss with clip-higher
  (0.2 / 0.28) and verl's dual clip, no KL, token-mean; scaled as TRL's "dapo" loss is, so the
  mean is over the tokens of the optimizer step on all processes.

A training step is one generation and `updates_per_step` optimizer steps: the step's kept
rollouts are shuffled and cut into micro-batches of `batch_size` per process, accumulated
`gradient_accumulation_steps` at a time, `epochs` passes; old log-probabilities are taken before
the first update when a step makes several (TRL does this), so the later updates are clipped
against the weights that sampled. Rollouts are re-tokenized from their text (a text can tokenize
differently from how it was sampled; the ratio stays consistent as both log-probabilities are
taken on the same ids). A rollout longer than `max_length` tokens is cut there: its later turns
are not trained, its advantage still comes from its whole trajectory's reward.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rstar_pipelines.agent.grpo import group_advantages, grpo_loss
from rstar_pipelines.agent.reward import AgentProblem, rewards
from rstar_pipelines.agent.roc import (
    PositiveSelection,
    format_penalty,
    resample_on_correct,
    tool_error_ratio,
)
from rstar_pipelines.agent.rollout import RolloutConfig, Trajectory, run_rollouts
from rstar_pipelines.llm import transformers_llm_class
from rstar_pipelines.training.config import LaunchConfig, TrainConfig
from rstar_pipelines.training.sft import chat_tokens

# The per-step figures train_grpo returns, one list each (one value per training step).
STEP_METRICS = (
    "mean_reward",  # over all rollouts, before RoC
    "tool_error_ratio",  # mean over all rollouts of RoC's tool-error ratio
    "tool_calls",  # mean calls per rollout
    "response_length",  # mean model tokens per rollout
    "groups_dropped",  # fraction of the step's groups whose rewards were all equal
    "kept",  # rollouts trained on
    "updates",  # optimizer steps that changed the weights (0: skipped)
    "loss",  # mean over the step's optimizer steps; None when skipped
    "clip_low",  # share of trained tokens clipped below, mean over optimizer steps
    "clip_high",
    "step_seconds",  # rollouts, rewards and updates
)
# The per-step figures as they go through TRL's log history (so they come back on resume).
_LOGGED = {name: f"roc/{name}" for name in STEP_METRICS[:6]}


class GRPOTrainConfig(TrainConfig):
    """GRPO-RoC settings. Defaults follow the released recipe (docs/agent.md) where it has one:
    G = 16 kept of 32, clip 0.2 / 0.28 with verl's dual clip 3, one pass over the rollouts,
    lr 1e-6 constant after the warm-up. `max_steps` does not apply: `steps` counts the training
    steps (rollouts, then the updates)."""

    lr: float = Field(1e-6, gt=0, description="learning rate, constant after the warm-up")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's (verl's actor default)")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="optimizer steps of linear warm-up (the reference's 20 are training steps, "
        "each one optimizer step there: its mini-batch is its whole batch)",
    )
    epochs: int = Field(1, ge=1, description="passes over a step's kept rollouts (ppo_epochs)")
    batch_size: int = Field(16, ge=1, description="kept rollouts per process and micro-batch")
    max_length: int = Field(
        4096, ge=2, description="most tokens of a rollout (prompt, turns, tool responses)"
    )
    steps: int = Field(10, ge=1, description="training steps")
    prompts_per_step: int = Field(8, ge=1, description="problems per step, one group each")
    group_size: int = Field(16, ge=2, description="rollouts per problem that RoC keeps (G)")
    oversample: int = Field(2, ge=1, description="rollouts per problem: oversample * group_size")
    min_each: int = Field(
        2, ge=0, description="RoC keeps at least this many positives and negatives (if it can)"
    )
    positive_selection: PositiveSelection = Field(
        "sample",
        description="sample: positives drawn favouring low penalty (the paper); lowest: the "
        "lowest penalties (the released code)",
    )
    no_call_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="tool-error ratio of a rollout without calls (the reference: 0.5)",
    )
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(3.0, gt=1, description="None: no dual clip")
    rollout: RolloutConfig = RolloutConfig()
    rollout_backend: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description="what samples the rollouts: vLLM in TRL's colocate mode (a GPU), transformers "
        "on the model being trained; auto: vLLM where a GPU and vLLM are there",
    )
    generation_batch_size: int = Field(
        16, ge=1, description="sequences transformers generates together"
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="the colocated vLLM engine's share of the GPU memory"
    )
    sandbox_backend: str = Field("auto", description="the training processes' own sandboxes")
    sandbox_workers: int | None = Field(None, ge=1, description="None: the number of CPUs")

    @model_validator(mode="after")
    def _consistent(self) -> GRPOTrainConfig:
        if self.max_steps is not None:
            raise ValueError("max_steps does not apply to GRPO: declare `steps` (training steps)")
        if self.group_size < 2 * self.min_each:
            raise ValueError(
                f"group_size {self.group_size} cannot keep min_each = {self.min_each} positives "
                "and as many negatives"
            )
        return self


def check_batches(config: GRPOTrainConfig, launch: LaunchConfig) -> int:
    """The micro-batches per process of a training step; a ValueError naming the setting when the
    step's rollouts cannot be cut as TRL needs: whole groups per process, whole micro-batches
    per process, whole accumulation windows."""
    processes, accumulate = launch.processes, launch.gradient_accumulation_steps
    if config.prompts_per_step % processes:
        raise ValueError(
            f"prompts_per_step ({config.prompts_per_step}) must be a multiple of launch.processes "
            f"({processes}): each process samples and resamples whole groups"
        )
    per_process = config.prompts_per_step // processes * config.group_size
    if per_process % config.batch_size:
        raise ValueError(
            f"each process trains {per_process} rollouts a step (prompts_per_step * group_size / "
            f"processes), which batch_size ({config.batch_size}) must divide"
        )
    micro_batches = per_process // config.batch_size
    if micro_batches % accumulate:
        raise ValueError(
            f"a step has {micro_batches} micro-batches per process, which "
            f"launch.gradient_accumulation_steps ({accumulate}) must divide"
        )
    return micro_batches


def rollout_tokens(
    tokenizer: Any, trajectory: Trajectory, max_length: int
) -> tuple[list[int], list[bool]]:
    """A rollout's token ids and its mask: True on the model-written tokens (`chat_tokens` over
    the prompt and every turn), cut to `max_length`."""
    return chat_tokens(tokenizer, [*trajectory.prompt, *trajectory.messages], max_length)


def train_grpo(
    model: Any,
    tokenizer: Any,
    problems: Sequence[AgentProblem],
    config: GRPOTrainConfig,
    sandbox: Any,
    prompts: Sequence[list[dict]],
    log: Callable[[str], Any] = print,
    *,
    output_dir: Path | None = None,
    launch: LaunchConfig | None = None,
) -> dict:
    """Train the causal LM `model` in place with GRPO-RoC and, with an output_dir, save it there
    with the tokenizer; returns the metrics. Resumes from the last complete checkpoint.

    `prompts[i]` is the chat (system and user messages) a rollout of `problems[i]` starts from.
    The metrics hold one list per name of STEP_METRICS, `losses` (every optimizer step's),
    `steps`, `examples` (problems) and `skipped_steps`.
    """
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig

    from rstar_pipelines.training import hf_trainer

    if len(prompts) != len(problems):
        raise ValueError(f"{len(prompts)} prompts for {len(problems)} problems")
    if not problems:
        raise ValueError("GRPO needs at least one problem")
    launch = launch or LaunchConfig()
    micro_batches = check_batches(config, launch)
    updates = micro_batches * config.epochs // launch.gradient_accumulation_steps
    use_vllm = _use_vllm(config)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(output_dir or scratch)
        args = _arguments(GRPOConfig, config, launch, out, micro_batches, updates, use_vllm)
        trainer = _grpo_roc_trainer(
            config,
            problems,
            sandbox,
            model=model,
            args=args,
            train_dataset=Dataset.from_list(
                [{"prompt": prompt, "problem": i} for i, prompt in enumerate(prompts)]
            ),
            processing_class=tokenizer,
            peft_config=hf_trainer.peft_config(launch, "CAUSAL_LM"),
            callbacks=hf_trainer.callbacks("GRPO", log),
        )
        trainer.remove_callback(PrinterCallback)
        log(
            f"GRPO-RoC: {len(problems)} problems, {config.steps} steps of "
            f"{config.prompts_per_step} prompts x {config.oversample * config.group_size} "
            f"rollouts, {updates} optimizer step(s) each; rollouts through "
            f"{'vLLM' if use_vllm else 'transformers'}"
        )
        torch.manual_seed(config.seed)
        resumed = hf_trainer.train(trainer, out, log)
        hf_trainer.finish(trainer, tokenizer, out if output_dir else None)
        model.eval()
        return _metrics(trainer, config, updates, len(problems), resumed)


def _arguments(
    config_class: type,
    config: GRPOTrainConfig,
    launch: LaunchConfig,
    out: Path,
    micro_batches: int,
    updates: int,
    use_vllm: bool,
) -> Any:
    """TRL's GRPOConfig for a GRPO-RoC run: its schedule, clipping and rollout engine."""
    from rstar_pipelines.training import hf_trainer

    return hf_trainer.arguments(
        config_class,
        config,
        launch,
        out,
        max_steps=config.steps * updates,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        num_generations=config.group_size,
        steps_per_generation=micro_batches,
        num_iterations=config.epochs,
        beta=0.0,
        epsilon=config.clip_low,
        epsilon_high=config.clip_high,
        delta=config.dual_clip,
        loss_type="dapo",
        max_completion_length=config.rollout.max_response_tokens,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        vllm_max_model_length=config.max_length,
        vllm_importance_sampling_correction=False,  # rollouts come back as text, not logprobs
        shuffle_dataset=True,
    )


def _metrics(
    trainer: Any, config: GRPOTrainConfig, updates: int, examples: int, resumed: int | None
) -> dict:
    """What train_grpo returns, from the trainer's log history."""
    per_step, losses = _per_step(trainer.state.log_history, updates)
    return {
        **per_step,
        "losses": losses,
        "steps": config.steps,
        "updates_per_step": updates,
        "examples": examples,
        "skipped_steps": sum(1 for n in per_step["updates"] if n == 0),
        "resumed_from_step": resumed,
        "processes": trainer.accelerator.num_processes,
    }


def _use_vllm(config: GRPOTrainConfig) -> bool:
    if config.rollout_backend != "auto":
        return config.rollout_backend == "vllm"
    from importlib.util import find_spec

    import torch

    return torch.cuda.is_available() and find_spec("vllm") is not None


def _per_step(history: list[dict], updates: int) -> tuple[dict[str, list], list[float]]:
    """The STEP_METRICS lists, and the loss of every optimizer step that made an update, from
    TRL's log history: a training step's rollout figures are logged with its first optimizer
    step; each optimizer step logs its loss, its clip shares and whether it changed the weights
    (`roc/updated`)."""
    steps = [entry for entry in history if "roc/updated" in entry]
    figures: dict[str, list] = {name: [] for name in STEP_METRICS}
    losses: list[float] = []
    for start in range(0, len(steps), updates):
        group = steps[start : start + updates]
        for name, key in _LOGGED.items():
            figures[name].append(group[0][key])
        made = [e for e in group if e["roc/updated"]]
        losses += [e["loss"] for e in made]
        figures["updates"].append(len(made))
        figures["loss"].append(statistics.fmean(e["loss"] for e in made) if made else None)
        for name in ("clip_low", "clip_high"):
            shares = [e[f"roc/{name}"] for e in made if f"roc/{name}" in e]
            figures[name].append(statistics.fmean(shares) if shares else None)
        figures["step_seconds"].append(round(sum(e.get("step_time", 0.0) for e in group), 3))
    return figures, losses


@contextmanager
def _without_autocast(model: Any) -> Iterator[None]:
    """The model's own forward while the block runs. Under mixed precision accelerate wraps a
    model's forward in autocast, and on a CPU autocast casts every float32 weight to bfloat16
    again at every decode step, which makes rollouts slower than in float32 (docs/benchmarks.md).
    The rollouts sample from the float32 weights instead, as a serving engine's rollouts sample from
    its own copy; the loss still takes its log-probabilities under autocast."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def _grpo_roc_trainer(
    config: GRPOTrainConfig, problems: Sequence[AgentProblem], sandbox: Any, **kwargs: Any
) -> Any:
    """A trl.GRPOTrainer with RoC's rollouts and the GRPO-RoC loss (see the module docstring)."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class GRPORoCTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self._rows = inputs  # the dataset rows behind the prompts roc_rollouts gets
            output = super()._generate_and_score_completions(inputs)
            # RoC's advantages (the rollout function put them on the rows) replace TRL's own.
            output["advantages"] = torch.tensor(
                [row["advantage"] for row in inputs], device=self.accelerator.device
            )
            self._step_kept_tokens = int(output["num_items_in_batch"])
            return output

        def roc_rollouts(self, prompts: list) -> dict[str, Any]:
            return _roc_rollouts(self, prompts, config, problems, sandbox)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:
                raise ValueError("GRPO-RoC returns no outputs")
            return _roc_loss(self, model, inputs, config)

    class SkipEmptySteps(TrainerCallback):
        """No update from an optimizer step that kept no rollout anywhere: with every gradient
        gone, AdamW leaves the weights, its moments and its step count alone."""

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            if trainer._step_kept_tokens == 0:
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None

    trainer = GRPORoCTrainer(
        reward_funcs=[_outcome_reward],
        rollout_func=lambda prompts, trainer: trainer.roc_rollouts(prompts),
        **kwargs,
    )
    trainer.add_callback(SkipEmptySteps())
    trainer._step_kept_tokens = 1
    return trainer


def _roc_rollouts(
    trainer: Any,
    prompts: list,
    config: GRPOTrainConfig,
    problems: Sequence[AgentProblem],
    sandbox: Any,
) -> dict[str, Any]:
    """TRL's rollout function: `oversample` times the group's rollouts per problem, scored,
    resampled by RoC and tokenized, the kept ones with their advantages."""
    group = trainer.num_generations
    rows = trainer._rows
    starts = range(0, len(rows), group)
    if any({r["problem"] for r in rows[s : s + group]} != {rows[s]["problem"]} for s in starts):
        raise RuntimeError("a process got a partial group: check_batches should prevent it")
    chosen = [problems[rows[s]["problem"]] for s in starts]
    seed = hash((config.seed, trainer.state.global_step, trainer.accelerator.process_index))
    rng = random.Random(seed)
    with _policy(trainer, config) as llm:
        groups = run_rollouts(
            llm,
            sandbox,
            [prompts[s] for s in starts],
            config.oversample * group,
            config.rollout,
            seed=seed % 2**31,
        )
    scores = rewards(groups, chosen, sandbox, config.rollout.timeout_s, config.rollout.memory_mb)
    kept, figures = _resample(groups, scores, config, rng)
    out = _rollout_batch(trainer.processing_class, kept, config.max_length)
    figures["kept"] = sum(1 for mask in out["env_mask"] if any(mask))
    _log_step_figures(trainer, figures)
    return {**out, "logprobs": None}


def _rollout_batch(
    tokenizer: Any, kept: list[tuple[Trajectory, float, float, bool]], max_length: int
) -> dict[str, list]:
    """The kept rollouts as TRL's rollout function returns them: prompt and completion ids, the
    mask of the trained tokens (none for a dropped group's stand-ins), rewards and advantages."""
    out: dict[str, list] = {
        "prompt_ids": [], "completion_ids": [], "env_mask": [], "reward": [], "advantage": [],
    }  # fmt: skip
    for trajectory, reward, advantage, trained in kept:
        ids, mask = rollout_tokens(tokenizer, trajectory, max_length)
        start = mask.index(True) if True in mask else len(ids) - 1
        out["prompt_ids"].append(ids[:start])
        out["completion_ids"].append(ids[start:])
        out["env_mask"].append([int(m and trained) for m in mask[start:]])
        out["reward"].append(reward)
        out["advantage"].append(advantage)
    return out


@contextmanager
def _policy(trainer: Any, config: GRPOTrainConfig) -> Iterator[Any]:
    """The policy as it is now, as an LLM: the colocated vLLM engine, or the model in training
    unwrapped for generation."""
    if trainer.use_vllm:
        from rstar_pipelines.llm.vllm_backend import VllmLLM

        yield VllmLLM.over_engine(trainer.vllm_generation.llm, name="grpo-policy")
        return
    from trl.models.utils import unwrap_model_for_generation

    with (
        unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model,
        _without_autocast(model),
    ):
        yield transformers_llm_class().wrap(
            model,
            trainer.processing_class,
            name="grpo-policy",
            batch_size=config.generation_batch_size,
        )


def _log_step_figures(trainer: Any, figures: dict[str, float]) -> None:
    """This step's rollout figures over all processes, into TRL's log of the next step."""
    import torch

    names = list(_LOGGED)
    local = torch.tensor([float(figures[n]) for n in names], device=trainer.accelerator.device)
    total = trainer.accelerator.gather(local).view(-1, len(names))
    for i, name in enumerate(names):
        value = total[:, i].sum() if name == "kept" else total[:, i].mean()
        trainer._metrics["train"][_LOGGED[name]].append(value.item())


def _roc_loss(trainer: Any, model: Any, inputs: dict, config: GRPOTrainConfig) -> Any:
    """The GRPO-RoC loss of one micro-batch, scaled as TRL's "dapo" loss."""
    import torch

    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    tokens = mask.sum()
    metrics = trainer._metrics["train"]
    if tokens == 0 and trainer.accelerator.num_processes == 1:
        # Every rollout here was dropped or cut, and no other process's gradient
        # all-reduce waits on this backward: a zero, without the model's forward and
        # backward (with every group dropped, three quarters of a CPU job's time).
        metrics["roc/updated"].append(float(trainer._step_kept_tokens > 0))
        return torch.zeros((), device=prompt_ids.device, requires_grad=True)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, completion_ids.size(1)
    )
    old = inputs.get("old_per_token_logps")
    old = logprobs.detach() if old is None else old
    if tokens == 0:  # on several processes, a zero through the model (DDP's backward)
        metrics["roc/updated"].append(float(trainer._step_kept_tokens > 0))
        return (logprobs * 0).sum()
    loss, stats = grpo_loss(
        logprobs,
        old,
        inputs["advantages"],
        mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip=config.dual_clip,
    )
    # The token-mean over this micro-batch, rescaled as TRL's "dapo" loss: over the
    # optimizer step's tokens on all processes (DDP averages the gradients).
    normalizer = (
        inputs["num_items_in_batch"].clamp(min=1.0)
        / trainer.accelerator.num_processes
        * trainer.current_gradient_accumulation_steps
        / trainer.args.steps_per_generation
    )
    metrics["roc/updated"].append(1.0)
    metrics["roc/clip_low"].append(stats["clip_fraction_low"])
    metrics["roc/clip_high"].append(stats["clip_fraction_high"])
    return loss * tokens / normalizer


def _outcome_reward(prompts, completions, reward, **kwargs) -> list[float]:
    """TRL's reward function: the binary outcome reward the rollout function already scored."""
    return list(reward)


def _resample(
    groups: list[list[Trajectory]],
    scores: list[list[float]],
    config: GRPOTrainConfig,
    rng: random.Random,
) -> tuple[list[tuple[Trajectory, float, float, bool]], dict[str, float]]:
    """Per group, the `group_size` rollouts to train on with their rewards and advantages, and
    whether they are trained (a dropped group's stand-ins are not); and the step's figures."""
    size = config.group_size
    kept: list[tuple[Trajectory, float, float, bool]] = []
    dropped = 0
    errors_all: list[float] = []
    for group, group_scores in zip(groups, scores, strict=True):
        errors = [
            tool_error_ratio([c.status for c in t.tool_calls], config.no_call_ratio) for t in group
        ]
        formats = [
            format_penalty([m["content"] for m in t.messages if m["role"] == "assistant"])
            for t in group
        ]
        errors_all += errors
        indices = resample_on_correct(
            group_scores,
            errors,
            formats,
            size,
            rng=rng,
            positive_selection=config.positive_selection,
            min_each=config.min_each,
        )
        if len(indices) == size:
            advantages = group_advantages([group_scores[i] for i in indices])
            kept += [
                (group[i], group_scores[i], a, True)
                for i, a in zip(indices, advantages, strict=True)
            ]
        else:  # dropped (equal rewards): stand-ins that weigh nothing
            dropped += 1
            kept += [(group[i], group_scores[i], 0.0, False) for i in range(size)]
    everyone = [t for group in groups for t in group]
    figures = {
        "mean_reward": statistics.fmean(s for group in scores for s in group),
        "tool_error_ratio": statistics.fmean(errors_all),
        "tool_calls": statistics.fmean(len(t.tool_calls) for t in everyone),
        "response_length": statistics.fmean(t.completion_tokens for t in everyone),
        "groups_dropped": dropped / len(groups),
    }
    return kept, figures
