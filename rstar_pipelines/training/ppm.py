"""The process preference model (PPM) of rStar-Math: the policy with a scalar value head.

It scores a partial solution (prompt + the steps so far); trained on pairs of a better and a worse
continuation of the same prefix with a pairwise (Bradley-Terry) loss (spec §2). The checkpoint is a
plain Hugging Face sequence-classification directory with one label and the step tags as special
tokens (the reference saves its value head to a separate value_head.bin instead).
"""

from __future__ import annotations

import copy
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rstar_pipelines.llm.value_model import ProcessPreferenceModel, ppm_input
from rstar_pipelines.training.base_models import add_tags, load_trainable
from rstar_pipelines.training.loop import (
    TrainConfig,
    batch_order,
    log_interval,
    optimizer_and_schedule,
    step,
)

if TYPE_CHECKING:
    import torch

# The value head's initial weights, as the reference draws them (spec §2.1).
HEAD_INIT_MEAN = 5e-7
HEAD_INIT_STD = 1e-6


class PPMTrainConfig(TrainConfig):
    """PPM training settings (spec §2.4): lr 7e-6 and one epoch, as in the paper."""

    heldout_fraction: float = Field(
        0.05, ge=0, lt=1, description="share of pairs held out, whole prompts at a time"
    )


def pairwise_loss(
    r_pos: torch.Tensor,
    r_neg: torch.Tensor,
    pos_count: Sequence[int],
    neg_count: Sequence[int],
) -> torch.Tensor:
    """The reference's pairwise loss (spec §2.3), summed over the batch.

    Per pair `-logsigmoid(r_pos - r_neg) / (pos_count * neg_count)`: a step with 2 chosen and 2
    rejected children yields 4 pairs, which together weigh as much as one. When either count is 0
    the factor is `1 / (pos_count + neg_count)`.
    """
    import torch
    import torch.nn.functional as F

    factors = [
        1 / (pos * neg) if pos and neg else 1 / (pos + neg)
        for pos, neg in zip(pos_count, neg_count, strict=True)
    ]
    factor = torch.tensor(factors, dtype=r_pos.dtype, device=r_pos.device)
    return (-F.logsigmoid(r_pos - r_neg) * factor).sum()


def with_value_head(causal_lm: Any) -> Any:
    """A sequence-classification model (one label) with the causal LM's backbone weights.

    Only the head (`score`) is new; any other missing or unexpected weight is an error. The head is
    drawn from N(5e-7, 1e-6) as in the reference, but unlike the reference's head it has no bias
    (1e-6 there) and no dropout (p=0.1 there) before it: it is transformers' own `score` layer, so
    the checkpoint loads anywhere. The value is read at the last token that is not padding, as
    transformers does with `pad_token_id` (set by `add_tags`).
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.architectures = None  # save_pretrained writes the sequence-classification class
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    # Causal LMs of transformers name their output layer lm_head; the backbone keys match.
    backbone = {k: v for k, v in causal_lm.state_dict().items() if not k.startswith("lm_head.")}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or set(missing) != {"score.weight"}:
        raise ValueError(
            f"{type(model).__name__} does not take {type(causal_lm).__name__}'s weights: "
            f"missing {sorted(set(missing) - {'score.weight'})}, unexpected {sorted(unexpected)}"
        )
    torch.nn.init.normal_(model.score.weight, mean=HEAD_INIT_MEAN, std=HEAD_INIT_STD)
    return model


def ppm_from_base(model_ref: str, **options: Any) -> ProcessPreferenceModel:
    """A new, untrained PPM from a policy ("embedded", a .gguf file or a Hugging Face directory)."""
    causal_lm, tokenizer = load_trainable(model_ref)
    add_tags(causal_lm, tokenizer)
    return ProcessPreferenceModel(with_value_head(causal_lm), tokenizer, **options)


def split_heldout(
    pairs: Sequence[dict], fraction: float, seed: int
) -> tuple[list[dict], list[dict]]:
    """(train, held-out) pairs. Whole prompts are held out, about `fraction` of the pairs, chosen
    by `seed`: pairs of one problem share prefixes, so splitting a problem would leak it into the
    held-out accuracy. At least one prompt stays for training."""
    pairs_per_prompt = Counter(pair["prompt"] for pair in pairs)
    prompts = sorted(pairs_per_prompt)
    random.Random(seed).shuffle(prompts)
    target = int(len(pairs) * fraction)
    heldout_prompts: set[str] = set()
    heldout_count = 0
    for prompt in prompts[1:]:
        if heldout_count >= target:
            break
        heldout_prompts.add(prompt)
        heldout_count += pairs_per_prompt[prompt]
    train = [pair for pair in pairs if pair["prompt"] not in heldout_prompts]
    heldout = [pair for pair in pairs if pair["prompt"] in heldout_prompts]
    return train, heldout


def preference_accuracy(
    ppm: ProcessPreferenceModel, pairs: Sequence[dict], max_length: int
) -> float | None:
    """Share of pairs whose chosen completion gets the higher raw value; None without pairs."""
    if not pairs:
        return None
    chosen, rejected = (
        ppm.values([ppm_input(ppm.tokenizer, p["prompt"], p[key]) for p in pairs], max_length)
        for key in ("chosen", "rejected")
    )
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


def train_ppm(
    ppm: ProcessPreferenceModel,
    pairs: list[dict],
    config: PPMTrainConfig,
    log: Callable[[str], Any] = print,
) -> dict:
    """Train `ppm` in place on preference pairs (keys prompt, chosen, rejected, pos_count,
    neg_count) with `pairwise_loss`; returns the metrics (losses per step, accuracies)."""
    import torch

    started = time.monotonic()
    torch.manual_seed(config.seed)
    train, heldout = split_heldout(pairs, config.heldout_fraction, config.seed)
    if not train:
        raise ValueError("no preference pairs to train on")
    accuracy_before = preference_accuracy(ppm, train, config.max_length)
    batches = batch_order(len(train), config)
    optimizer, schedule = optimizer_and_schedule(ppm.model, config, len(batches))
    every = log_interval(len(batches))
    log(f"PPM: {len(train)} pairs ({len(heldout)} held out), {len(batches)} steps")
    ppm.model.train()
    losses = []
    for number, indices in enumerate(batches, 1):
        batch = [train[i] for i in indices]
        texts = [
            ppm_input(ppm.tokenizer, pair["prompt"], pair[key])
            for key in ("chosen", "rejected")
            for pair in batch
        ]
        values = ppm.forward(texts, config.max_length)
        loss = pairwise_loss(
            values[: len(batch)],
            values[len(batch) :],
            [pair["pos_count"] for pair in batch],
            [pair["neg_count"] for pair in batch],
        )
        losses.append(step(ppm.model, loss, optimizer, schedule, config))
        if number % every == 0 or number == len(batches):
            log(f"PPM step {number}/{len(batches)}: loss {losses[-1]:.4f}")
    ppm.model.eval()
    return {
        "losses": losses,
        "train_accuracy_before": accuracy_before,
        "train_accuracy_after": preference_accuracy(ppm, train, config.max_length),
        "heldout_accuracy": preference_accuracy(ppm, heldout, config.max_length),
        "train_pairs": len(train),
        "heldout_pairs": len(heldout),
        "steps": len(batches),
        "seconds": round(time.monotonic() - started, 3),
    }
