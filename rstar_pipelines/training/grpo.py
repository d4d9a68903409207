"""GRPO-RoC: rStar2-Agent's agentic RL of the policy (spec §6.4), in one process.

Each training step:
1. picks `prompts_per_step` problems (seeded) and samples `oversample * group_size` multi-turn
   rollouts of each with the model being trained (`TransformersLLM.wrap`: its current weights),
   the Python tool running in the sandbox;
2. scores them with the binary outcome reward;
3. per problem, Resample-on-Correct keeps `group_size` rollouts (a group whose rewards are all
   equal is dropped) and GRPO normalises the kept rewards into advantages;
4. renders every kept rollout with the chat template into tokens with a mask (`chat_tokens`,
   as SFT renders): 1 on each assistant turn and the template's end-of-turn after it, 0 on the
   prompt, the tool-response turns and the template's markup. With ChatML the end-of-turn is
   `<|im_end|>` and a newline the model never samples (generation stops at EOS): it is
   trained too, as in SFT, which costs nothing and keeps one renderer;
5. takes the log-probabilities of the kept rollouts under the weights that sampled them (one
   no-grad pass, before any update), then makes `epochs` passes of mini-batch optimizer steps
   (`batch_size` rollouts each) with the clipped policy loss. With several mini-batches per step
   the later ones run on weights already moved, which is what the clipping acts on.
A step that keeps no group (every group's rewards were equal) makes no update; its loss is None.

Rollouts are re-tokenized from their text, not kept as the sampled ids: a text can tokenize
differently from how it was sampled. The old log-probabilities are taken on the re-tokenized
sequence, so the ratio is consistent; only the behaviour policy is approximated on such tokens.
A rollout longer than `max_length` tokens is cut there: the tokens after the cut (and their mask)
are dropped, so its later turns are not trained, while its advantage still comes from its full
trajectory's reward. A rollout cut before its first assistant token has nothing to train.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

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
from rstar_pipelines.training.loop import TrainConfig, step
from rstar_pipelines.training.sft import chat_tokens

# The per-step figures train_grpo returns, one list each.
STEP_METRICS = (
    "mean_reward",  # over all rollouts, before RoC
    "tool_error_ratio",  # mean over all rollouts of RoC's tool-error ratio
    "tool_calls",  # mean calls per rollout
    "response_length",  # mean model tokens per rollout
    "groups_dropped",  # fraction of the step's groups whose rewards were all equal
    "kept",  # rollouts trained on
    "updates",  # optimizer steps made (0: skipped)
    "loss",  # mean over the step's optimizer steps; None when skipped
    "clip_low",  # share of trained tokens clipped below, mean over optimizer steps
    "clip_high",
    "step_seconds",
)


class GRPOTrainConfig(TrainConfig):
    """GRPO-RoC settings. Defaults follow the released recipe (spec §6.4) where it has one:
    G = 16 kept of 32, clip 0.2 / 0.28 with verl's dual clip 3, one pass over the rollouts,
    lr 1e-6 constant after the warm-up. `max_steps` does not apply: `steps` counts the training
    steps (rollouts, then an update)."""

    lr: float = Field(1e-6, gt=0, description="learning rate, constant after the warm-up")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's (verl's actor default)")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="optimizer steps of linear warm-up, the first at lr / warmup_steps (the "
        "reference's 20 are training steps, each one optimizer step there: its mini-batch is "
        "its whole batch)",
    )
    epochs: int = Field(1, ge=1, description="passes over a step's kept rollouts (ppo_epochs)")
    batch_size: int = Field(16, ge=1, description="kept rollouts per optimizer step")
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
    generation_batch_size: int = Field(16, ge=1, description="sequences generated together")
    sandbox_backend: str = Field("auto", description="the training process's own sandbox")
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


def train_grpo(
    model: Any,
    tokenizer: Any,
    problems: Sequence[AgentProblem],
    config: GRPOTrainConfig,
    sandbox: Any,
    prompts: Sequence[list[dict]],
    log: Callable[[str], Any] = print,
) -> dict:
    """Train the causal LM `model` in place with GRPO-RoC; returns the metrics.

    `prompts[i]` is the chat (system and user messages) a rollout of `problems[i]` starts from.
    The metrics hold one list per name of STEP_METRICS, `losses` (every optimizer step's),
    `steps`, `examples` (problems), `skipped_steps` and `seconds` (the whole run's).
    """
    import torch

    from rstar_pipelines.llm.transformers_backend import TransformersLLM

    if len(prompts) != len(problems):
        raise ValueError(f"{len(prompts)} prompts for {len(problems)} problems")
    if not problems:
        raise ValueError("GRPO needs at least one problem")
    started = time.monotonic()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    llm = TransformersLLM.wrap(
        model, tokenizer, name="grpo-policy", batch_size=config.generation_batch_size
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    warmup = config.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    log(
        f"GRPO-RoC: {len(problems)} problems, {config.steps} steps of {config.prompts_per_step} "
        f"prompts x {config.oversample * config.group_size} rollouts"
    )
    metrics: dict[str, Any] = {name: [] for name in STEP_METRICS}
    losses: list[float] = []
    for number in range(1, config.steps + 1):
        step_started = time.monotonic()
        chosen = rng.sample(range(len(problems)), min(config.prompts_per_step, len(problems)))
        groups = run_rollouts(
            llm,
            sandbox,
            [prompts[i] for i in chosen],
            config.oversample * config.group_size,
            config.rollout,
            seed=rng.randrange(2**31),
        )
        scores = rewards(
            groups,
            [problems[i] for i in chosen],
            sandbox,
            config.rollout.timeout_s,
            config.rollout.memory_mb,
        )
        kept, figures = _resample(groups, scores, config, rng)
        rows = [(*rollout_tokens(tokenizer, t, config.max_length), a) for t, a in kept]
        trainable = [row for row in rows if any(row[1])]  # not cut before its first turn
        step_losses, clips = _update(model, trainable, config, optimizer, schedule, tokenizer, rng)
        losses += step_losses
        figures.update(
            kept=len(trainable),
            updates=len(step_losses),
            loss=statistics.fmean(step_losses) if step_losses else None,
            clip_low=statistics.fmean(c[0] for c in clips) if clips else None,
            clip_high=statistics.fmean(c[1] for c in clips) if clips else None,
            step_seconds=round(time.monotonic() - step_started, 3),
        )
        for name in STEP_METRICS:
            metrics[name].append(figures[name])
        log(_step_line(number, config.steps, figures))
    model.eval()
    return {
        **metrics,
        "losses": losses,
        "steps": config.steps,
        "examples": len(problems),
        "skipped_steps": sum(1 for n in metrics["updates"] if n == 0),
        "seconds": round(time.monotonic() - started, 3),
    }


def rollout_tokens(
    tokenizer: Any, trajectory: Trajectory, max_length: int
) -> tuple[list[int], list[bool]]:
    """A rollout's token ids and its mask: True on the model-written tokens (`chat_tokens` over
    the prompt and every turn), cut to `max_length`."""
    return chat_tokens(tokenizer, [*trajectory.prompt, *trajectory.messages], max_length)


def _resample(
    groups: list[list[Trajectory]],
    scores: list[list[float]],
    config: GRPOTrainConfig,
    rng: random.Random,
) -> tuple[list[tuple[Trajectory, float]], dict[str, Any]]:
    """The kept rollouts with their advantages, and the step's rollout figures."""
    kept: list[tuple[Trajectory, float]] = []
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
            config.group_size,
            rng=rng,
            positive_selection=config.positive_selection,
            min_each=config.min_each,
        )
        if not indices:
            dropped += 1
            continue
        advantages = group_advantages([group_scores[i] for i in indices])
        kept += [(group[i], a) for i, a in zip(indices, advantages, strict=True)]
    everyone = [t for group in groups for t in group]
    figures = {
        "mean_reward": statistics.fmean(s for group in scores for s in group),
        "tool_error_ratio": statistics.fmean(errors_all),
        "tool_calls": statistics.fmean(len(t.tool_calls) for t in everyone),
        "response_length": statistics.fmean(t.completion_tokens for t in everyone),
        "groups_dropped": dropped / len(groups),
    }
    return kept, figures


def _update(
    model: Any,
    rows: list[tuple[list[int], list[bool], float]],
    config: GRPOTrainConfig,
    optimizer: Any,
    schedule: Any,
    tokenizer: Any,
    rng: random.Random,
) -> tuple[list[float], list[tuple[float, float]]]:
    """The optimizer steps on the kept rollouts: their losses and (clip_low, clip_high) shares."""
    import torch

    if not rows:
        return [], []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = list(range(len(rows)))
    rng.shuffle(order)
    batches = [
        _batch([rows[i] for i in order[start : start + config.batch_size]], pad_id, model.device)
        for start in range(0, len(order), config.batch_size)
    ]
    # Same mode for the old and the new log-probabilities: only the weights differ between them.
    model.train()
    with torch.no_grad():
        old = [_token_logprobs(model, batch) for batch in batches]
    losses, clips = [], []
    for _ in range(config.epochs):
        for batch, old_logprobs in zip(batches, old, strict=True):
            logprobs = _token_logprobs(model, batch)
            loss, stats = grpo_loss(
                logprobs,
                old_logprobs,
                batch["advantages"],
                batch["mask"],
                clip_low=config.clip_low,
                clip_high=config.clip_high,
                dual_clip=config.dual_clip,
            )
            losses.append(step(model, loss, optimizer, schedule, config))
            clips.append((stats["clip_fraction_low"], stats["clip_fraction_high"]))
    return losses, clips


def _batch(rows: list[tuple[list[int], list[bool], float]], pad_id: int, device: Any) -> dict:
    """Right-padded ids, attention mask, the loss mask of the predicted tokens, advantages.

    `mask` is over tokens 1..T-1 from the first trained token of the batch on (the positions the
    log-probabilities cover); padding is 0 in both masks."""
    import torch

    width = max(len(ids) for ids, _, _ in rows)
    start = min(mask.index(True) for _, mask, _ in rows)  # never 0: a prompt comes first
    ids = [ids + [pad_id] * (width - len(ids)) for ids, _, _ in rows]
    trained = [mask + [False] * (width - len(mask)) for _, mask, _ in rows]
    return {
        "input_ids": torch.tensor(ids, device=device),
        "attention_mask": torch.tensor(
            [[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows], device=device
        ),
        "start": start,
        "mask": torch.tensor([m[start:] for m in trained], dtype=torch.float32, device=device),
        "advantages": torch.tensor([a for _, _, a in rows], dtype=torch.float32, device=device),
    }


def _token_logprobs(model: Any, batch: dict) -> Any:
    """log p(token | the tokens before it) of tokens start..T-1, [B, T - start].

    Only the logits of the positions that predict them are computed (`logits_to_keep`): the
    prompt, shared by a whole group and most of a short rollout, needs none."""
    import torch

    ids, start = batch["input_ids"], batch["start"]
    keep = ids.shape[1] - start + 1
    logits = (
        model(
            input_ids=ids,
            attention_mask=batch["attention_mask"],
            logits_to_keep=keep,
            use_cache=False,
        )
        .logits[:, :-1]
        .float()
    )
    targets = ids[:, start:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _step_line(number: int, steps: int, f: dict[str, Any]) -> str:
    update = (
        f"loss {f['loss']:.4f} over {f['updates']} updates"
        if f["updates"]
        else "no group kept, no update"
    )
    return (
        f"GRPO step {number}/{steps}: reward {f['mean_reward']:.3f}, tool errors "
        f"{f['tool_error_ratio']:.3f}, length {f['response_length']:.1f}, groups dropped "
        f"{f['groups_dropped']:.2f}, kept {f['kept']}, {update}, {f['step_seconds']:.1f} s"
    )
