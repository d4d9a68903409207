"""PPM training on trl.RewardTrainer, saving and scoring, on a tiny random Llama with the real
tokenizer."""

from __future__ import annotations

import math

import pytest
import torch

from rstar_pipelines.math.steps import STEP_END, TAGS
from rstar_pipelines.training.ppm import (
    PPMTrainConfig,
    ProcessPreferenceModel,
    ppm_from_base,
    ppm_input,
    split_heldout,
    train_ppm,
)
from tests.fakes.training import separable_pairs


@pytest.fixture(scope="module")
def trained(tiny_base):
    torch.manual_seed(0)  # the new head and the tags' embeddings are drawn at random
    ppm = ppm_from_base(tiny_base)
    config = PPMTrainConfig(
        lr=3e-3, epochs=6, batch_size=4, heldout_fraction=0.2, seed=1, eval_steps=8
    )
    logged: list[str] = []
    metrics = train_ppm(ppm, separable_pairs(20), config, log=logged.append)
    return ppm, metrics, logged


@pytest.mark.slow
def test_training_separates_the_pairs(trained):
    _, metrics, logged = trained
    losses = metrics["losses"]
    assert metrics["train_pairs"] == 16 and metrics["heldout_pairs"] == 4
    assert metrics["steps"] == len(losses) == 6 * 4
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4])
    # Before training the value barely depends on the text: all pairs tend to fall one way.
    # Accuracy is a share of the 16 training pairs, and training raises it.
    assert (metrics["train_accuracy_before"] * 16).is_integer()
    assert metrics["train_accuracy_before"] < metrics["train_accuracy_after"]
    assert metrics["train_accuracy_after"] >= 0.9
    assert metrics["heldout_accuracy"] >= 0.75  # above chance (0.5) on prompts never trained on
    # Evaluated on the held-out pairs every 8 steps; the last one is the final model's.
    assert len(metrics["heldout_accuracy_curve"]) == 3
    assert metrics["heldout_accuracy_curve"][-1] == metrics["heldout_accuracy"]
    assert any(line.startswith("PPM step 24/24: loss") for line in logged)


@pytest.mark.slow
def test_reloaded_checkpoint_scores_the_same(trained, tmp_path):
    ppm, _, _ = trained
    pairs = separable_pairs(4)
    prompts = [pair["prompt"] for pair in pairs]
    completions = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
    ppm.save(tmp_path / "ppm")
    loaded = ProcessPreferenceModel.load(tmp_path / "ppm")
    assert loaded.raw_scores(prompts * 2, completions) == pytest.approx(
        ppm.raw_scores(prompts * 2, completions), abs=1e-5
    )
    for tag in TAGS:
        [tag_id] = loaded.tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert tag_id in loaded.tokenizer.all_special_ids


@pytest.mark.slow
def test_padding_does_not_change_a_value(trained):
    ppm, _, _ = trained
    texts = ["short", ppm_input(ppm.tokenizer, "What is 1 + 1?", "x = 1 + 1" * 5)]
    one_by_one = [ppm.values([text])[0] for text in texts]
    assert ppm.values(texts) == pytest.approx(one_by_one, abs=1e-5)


@pytest.mark.slow
def test_score_is_tanh_of_raw_over_5_for_chat_and_text(trained):
    ppm, _, _ = trained
    prompt, completion = "What is 3 + 3?", f"x = 6{STEP_END}"
    [raw] = ppm.raw_scores([prompt], [completion])
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    text = ppm_input(ppm.tokenizer, prompt, completion)
    assert ppm.score([chat, text]) == pytest.approx([math.tanh(raw / 5)] * 2, abs=1e-6)
    assert text.endswith(completion)  # the assistant turn is left open


def test_heldout_split_keeps_prompts_whole_and_is_seeded():
    pairs = [{"prompt": f"p{i % 10}", "n": i} for i in range(40)]
    train, heldout = split_heldout(pairs, 0.1, seed=3)
    assert len(heldout) == 4 and len(train) == 36
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in heldout}
    assert split_heldout(pairs, 0.1, seed=3) == (train, heldout)
    assert split_heldout(pairs, 0.0, seed=3) == (pairs, [])
    assert split_heldout(pairs[:1], 0.9, seed=3) == (pairs[:1], [])
