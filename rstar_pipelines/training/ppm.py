"""The process preference model (PPM) of rStar-Math: the policy with a scalar value head.

It scores a partial solution (prompt + the steps so far); trained with `trl.RewardTrainer` on pairs
of a better and a worse continuation of the same prefix, with rStar-Math's pairwise loss weighted
1/(pos·neg) in place of TRL's (docs/training.md), and evaluated by its held-out pairwise accuracy.
The checkpoint is a plain Hugging Face sequence-classification directory with one label and the
step tags as special tokens (the reference saves its value head to a separate value_head.bin).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rstar_pipelines.llm.value_model import ProcessPreferenceModel, ppm_input
from rstar_pipelines.training.base_models import add_tags, load_trainable
from rstar_pipelines.training.config import LaunchConfig, TrainConfig

if TYPE_CHECKING:
    import torch

# The value head's initial weights, as the reference draws them (docs/training.md).
HEAD_INIT_MEAN = 5e-7
HEAD_INIT_STD = 1e-6


class PPMTrainConfig(TrainConfig):
    """PPM training settings (the reference's): lr 7e-6 and one epoch, as in the paper; 5% of the
    pairs held out; evaluated on them every `eval_steps` (750 there) and when training ends."""

    heldout_fraction: float = Field(
        0.05, ge=0, lt=1, description="share of pairs held out, whole prompts at a time"
    )
    eval_steps: int | None = Field(
        None, ge=1, description="held-out accuracy every this many steps; None: at the end only"
    )


def pair_weight(pos_count: int, neg_count: int) -> float:
    """A pair's weight in the loss: `1 / (pos_count * neg_count)`, so that the pairs of one step
    (2 chosen x 2 rejected children make 4) together weigh as much as one; `1 / (pos_count +
    neg_count)` when either count is 0, as the reference does."""
    return 1 / (pos_count * neg_count) if pos_count and neg_count else 1 / (pos_count + neg_count)


def pairwise_loss(r_pos: torch.Tensor, r_neg: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rStar-Math's pairwise loss: the mean over the batch of `-logsigmoid(r_pos - r_neg) * weight`.

    The reference sums over each device's batch; the mean is that sum divided by the per-device
    batch size, a constant that Adam's scale invariance absorbs (up to gradient clipping). It
    makes the loss the same however a batch is split over processes and accumulation steps."""
    import torch.nn.functional as F

    return (-F.logsigmoid(r_pos - r_neg) * weights.to(r_pos.dtype)).mean()


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


def preference_dataset(tokenizer: Any, pairs: Sequence[dict], max_length: int) -> Any:
    """The tokenized pairs RewardTrainer reads: `chosen_ids` and `rejected_ids` (`ppm_input` of the
    prompt with each completion, cut to its last max_length tokens, as scoring cuts) and
    `weight` (`pair_weight` of the pair's counts)."""
    from datasets import Dataset

    def ids(prompt: str, completion: str) -> list[int]:
        text = ppm_input(tokenizer, prompt, completion)
        return tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:]

    return Dataset.from_list(
        [
            {
                "chosen_ids": ids(pair["prompt"], pair["chosen"]),
                "rejected_ids": ids(pair["prompt"], pair["rejected"]),
                "weight": pair_weight(pair["pos_count"], pair["neg_count"]),
            }
            for pair in pairs
        ]
    )


def _ppm_trainer(**kwargs: Any) -> Any:
    """A trl.RewardTrainer whose loss is `pairwise_loss` and whose accuracy is exact: the share of
    all evaluated pairs (gathered across processes) whose chosen completion scores higher."""
    import torch
    from trl import RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    class WeightedPreferenceCollator(DataCollatorForPreference):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            batch = super().torch_call(examples)
            batch["weight"] = torch.tensor([e["weight"] for e in examples], dtype=torch.float32)
            return batch

    class PPMTrainer(RewardTrainer):
        pair_correct: list[float]

        def _set_signature_columns_if_needed(self):
            if self._signature_columns is None:
                self._signature_columns = ["chosen_ids", "rejected_ids", "weight"]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            outputs = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                use_cache=False,
            )
            chosen, rejected = outputs.logits[:, 0].chunk(2)
            loss = pairwise_loss(chosen, rejected, inputs["weight"])
            with torch.no_grad():
                correct = self.accelerator.gather_for_metrics((chosen > rejected).float())
                margin = self.accelerator.gather_for_metrics(chosen - rejected)
                self._metrics[mode]["accuracy"].extend(correct.tolist())
                self._metrics[mode]["margin"].extend(margin.tolist())
                if mode == "eval":
                    self.pair_correct.extend(correct.tolist())
            return (loss, outputs) if return_outputs else loss

        def accuracy(self, dataset: Any, name: str) -> float | None:
            """The pairwise accuracy on `dataset`, evaluated as the Trainer evaluates."""
            if dataset is None or len(dataset) == 0:
                return None
            self.pair_correct = []
            self.evaluate(dataset, metric_key_prefix=name)
            return sum(self.pair_correct) / len(self.pair_correct)

    tokenizer = kwargs["processing_class"]
    trainer = PPMTrainer(
        data_collator=WeightedPreferenceCollator(pad_token_id=tokenizer.pad_token_id), **kwargs
    )
    trainer.pair_correct = []
    return trainer


def train_ppm(
    ppm: ProcessPreferenceModel,
    pairs: list[dict],
    config: PPMTrainConfig,
    log: Callable[[str], Any] = print,
    *,
    output_dir: Path | None = None,
    launch: LaunchConfig | None = None,
) -> dict:
    """Train `ppm` in place on preference pairs (keys prompt, chosen, rejected, pos_count,
    neg_count) and, with an output_dir, save it there; returns the metrics (losses per step,
    pairwise accuracies on the training pairs before and after, and on the held-out pairs at
    the end and every eval_steps). Resumes from the last complete checkpoint under output_dir."""
    import tempfile

    from transformers import PrinterCallback
    from trl import RewardConfig

    from rstar_pipelines.training import hf_trainer

    launch = launch or LaunchConfig()
    train, heldout = split_heldout(pairs, config.heldout_fraction, config.seed)
    if not train:
        raise ValueError("no preference pairs to train on")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(output_dir or scratch)
        periodic = config.eval_steps is not None and bool(heldout)
        args = hf_trainer.arguments(
            RewardConfig,
            config,
            launch,
            out,
            max_length=None,  # cut when tokenized, keeping the end (the step being judged)
            eval_strategy="steps" if periodic else "no",
            eval_steps=config.eval_steps,
        )
        train_data = preference_dataset(ppm.tokenizer, train, config.max_length)
        heldout_data = preference_dataset(ppm.tokenizer, heldout, config.max_length)
        trainer = _ppm_trainer(
            model=ppm.model,
            args=args,
            train_dataset=train_data,
            eval_dataset=heldout_data if periodic else None,
            processing_class=ppm.tokenizer,
            peft_config=hf_trainer.peft_config(launch, "SEQ_CLS", modules_to_save=["score"]),
            callbacks=hf_trainer.callbacks("PPM", log),
        )
        trainer.remove_callback(PrinterCallback)
        log(f"PPM: {len(train)} pairs ({len(heldout)} held out)")
        accuracies = {"train_accuracy_before": trainer.accuracy(train_data, "train_before")}
        resumed = hf_trainer.train(trainer, out, log)
        accuracies["train_accuracy_after"] = trainer.accuracy(train_data, "train_after")
        accuracies["heldout_accuracy"] = trainer.accuracy(heldout_data, "heldout")
        ppm.model = hf_trainer.finish(trainer, ppm.tokenizer, out if output_dir else None)
        ppm.model.eval()
        return _metrics(trainer, accuracies, len(train), len(heldout), resumed)


def _metrics(
    trainer: Any,
    accuracies: dict[str, float | None],
    train_pairs: int,
    heldout_pairs: int,
    resumed: int | None,
) -> dict:
    """What train_ppm returns: the losses, the pairwise accuracies, the periodic held-out
    evaluations and the run's size."""
    from rstar_pipelines.training import hf_trainer

    return {
        "losses": hf_trainer.logged(trainer, "loss"),
        **accuracies,
        # The periodic evaluations (the others log under their own prefix, e.g. train_before).
        "heldout_accuracy_curve": [
            e["eval_accuracy"] for e in trainer.state.log_history if "eval_loss" in e
        ],
        "train_pairs": train_pairs,
        "heldout_pairs": heldout_pairs,
        "steps": trainer.state.global_step,
        "resumed_from_step": resumed,
        "processes": trainer.accelerator.num_processes,
    }
