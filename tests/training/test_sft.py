"""Policy SFT on trl.SFTTrainer with a tiny random Llama and the real tokenizer: the labels, the
loss, the checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer

from rstar_pipelines.llm import Completion, SamplingParams, load_llm
from rstar_pipelines.training.base_models import add_tags, load_trainable
from rstar_pipelines.training.config import LaunchConfig
from rstar_pipelines.training.sft import SFTTrainConfig, chat_tokens, sft_trainer, train_sft

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "The answer is 6."},
]


def _runs(tokenizer, ids: list[int], trained: list) -> tuple[list[str], list[str]]:
    """The decoded maximal runs of trained and of untrained tokens, in order."""
    runs: dict[bool, list[list[int]]] = {True: [], False: []}
    for i, (token, flag) in enumerate(zip(ids, trained, strict=True)):
        flag = bool(flag)
        if i == 0 or bool(trained[i - 1]) != flag:
            runs[flag].append([])
        runs[flag][-1].append(token)
    return [tokenizer.decode(r) for r in runs[True]], [tokenizer.decode(r) for r in runs[False]]


def test_only_the_assistant_turns_and_their_end_of_turn_are_trained(embedded_tokenizer):
    tok = embedded_tokenizer
    ids, trained = chat_tokens(tok, CONVERSATION)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    assistant, rest = _runs(tok, ids, trained)
    assert assistant == ["Four.<|im_end|>\n", "The answer is 6.<|im_end|>\n"]
    # What the model is given: system and user turns, each up to the generation prompt.
    assert rest[0].endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert rest[1] == "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert ids[: trained.index(True)] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert chat_tokens(tok, CONVERSATION, max_length=len(ids) - 3) == (ids[:-3], trained[:-3])


def test_refuses_what_it_cannot_mask(embedded_tokenizer):
    with pytest.raises(ValueError, match="must end with an assistant message"):
        chat_tokens(embedded_tokenizer, CONVERSATION[:-1])
    tokenizer = copy.deepcopy(embedded_tokenizer)
    # A template that renders earlier turns differently once an answer follows them.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ('!' if loop.last else '') + ': ' + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ValueError, match="cannot be told apart"):
        chat_tokens(tokenizer, CONVERSATION)


def test_sft_trainer_labels_only_assistant_turns_and_drops_examples_without_any(
    tiny_base, tmp_path
):
    model, tokenizer = load_trainable(tiny_base)
    add_tags(model, tokenizer)
    long_prompt = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "x"}]
    examples = [{"messages": CONVERSATION}, {"messages": long_prompt}]
    config = SFTTrainConfig(max_length=64)
    trainer = sft_trainer(model, tokenizer, examples, config, tmp_path, log=lambda _: None)
    [row] = trainer.train_dataset  # the long prompt fills max_length: no target left
    labels = [label != -100 for label in row["labels"]]
    assistant, _ = _runs(tokenizer, row["input_ids"], labels)
    assert assistant == ["Four.<|im_end|>\n", "The answer is 6.<|im_end|>\n"]
    assert [t for t, keep in zip(row["input_ids"], labels, strict=True) if keep] == [
        label for label in row["labels"] if label != -100
    ]


def examples() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"<answer>The answer is {2 * i}.<end_of_answer>"},
            ]
        }
        for i in range(4)
    ]


@pytest.mark.slow
def test_loss_falls_and_the_checkpoint_generates(tiny_base, tmp_path, monkeypatch):
    model, tokenizer = load_trainable(tiny_base)
    add_tags(model, tokenizer)
    config = SFTTrainConfig(lr=3e-2, epochs=6, batch_size=2, seed=0)
    lines: list[str] = []
    out = tmp_path / "policy"
    saved_at = []  # the steps of the resumable checkpoints written
    save = Trainer._save_checkpoint
    monkeypatch.setattr(
        Trainer,
        "_save_checkpoint",
        lambda self, *args: saved_at.append(self.state.global_step) or save(self, *args),
    )
    metrics = train_sft(
        model,
        tokenizer,
        examples(),
        config,
        lines.append,
        output_dir=out,
        launch=LaunchConfig(save_steps=5),
    )
    losses = metrics["losses"]
    assert metrics["steps"] == len(losses) == 12 and metrics["examples"] == 4
    assert metrics["final_loss"] == losses[-1] < 0.5 * losses[0]
    assert any(line.startswith("SFT step 12/12: loss") for line in lines)
    # Every save_steps, but none after the last step, where the model itself is written next.
    assert saved_at == [5, 10]
    assert not list(out.glob("checkpoint-*"))  # the resumable checkpoints go at the end

    llm = load_llm("transformers", str(out), batch_size=2)
    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    [[completion]] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    # A 2-layer model after 12 steps writes no sensible answer; that it generates is the point.
    assert isinstance(completion, Completion) and completion.completion_tokens >= 1


def test_lora_trains_an_adapter_and_saves_it_merged(tiny_base, tmp_path):
    from transformers import AutoModelForCausalLM

    from rstar_pipelines.training.config import LaunchConfig, LoraSettings

    model, tokenizer = load_trainable(tiny_base)
    add_tags(model, tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    launch = LaunchConfig(lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    config = SFTTrainConfig(lr=3e-2, epochs=1, batch_size=2)
    out = tmp_path / "lora"
    quiet = lambda _: None  # noqa: E731
    metrics = train_sft(model, tokenizer, examples(), config, quiet, output_dir=out, launch=launch)
    assert metrics["steps"] == 2
    assert not (out / "adapter_config.json").exists()  # merged: a plain model directory
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(saved) == set(before)
    changed = [k for k in before if not torch.equal(before[k], saved[k])]
    assert changed and all("proj" in k for k in changed)  # the adapted linear layers only
