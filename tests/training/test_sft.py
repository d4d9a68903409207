"""Policy SFT on a tiny random Llama with the real tokenizer: the mask, the loss, the checkpoint."""

from __future__ import annotations

import copy

import pytest

from rstar_pipelines.llm import Completion, SamplingParams, load_llm
from rstar_pipelines.training.base_models import add_tags, load_trainable
from rstar_pipelines.training.sft import IGNORE, SFTTrainConfig, sft_tokens, train_sft

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "The answer is 6."},
]


def test_only_the_final_answer_and_its_end_of_turn_carry_labels(embedded_tokenizer):
    tokenizer = embedded_tokenizer
    input_ids, labels = sft_tokens(tokenizer, CONVERSATION, max_length=512)
    assert len(input_ids) == len(labels)
    start = next(i for i, label in enumerate(labels) if label != IGNORE)
    assert all(label == IGNORE for label in labels[:start])
    assert labels[start:] == input_ids[start:]
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:-1], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(input_ids[:start]) == prompt
    assert tokenizer.decode(labels[start:]) == "The answer is 6.<|im_end|>\n"


def test_truncation_cuts_the_target_from_the_end(embedded_tokenizer):
    full_ids, full_labels = sft_tokens(embedded_tokenizer, CONVERSATION, max_length=512)
    input_ids, labels = sft_tokens(embedded_tokenizer, CONVERSATION, max_length=len(full_ids) - 3)
    assert (input_ids, labels) == (full_ids[:-3], full_labels[:-3])


def test_refuses_what_it_cannot_mask(embedded_tokenizer):
    with pytest.raises(ValueError, match="must end with an assistant message"):
        sft_tokens(embedded_tokenizer, CONVERSATION[:-1], max_length=512)
    tokenizer = copy.deepcopy(embedded_tokenizer)
    # A template that renders earlier turns differently once an answer follows them.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ('!' if loop.last else '') + ': ' + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ValueError, match="cannot be told apart"):
        sft_tokens(tokenizer, CONVERSATION, max_length=512)


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


def test_loss_falls_and_the_checkpoint_generates(tiny_base, tmp_path):
    model, tokenizer = load_trainable(tiny_base)
    add_tags(model, tokenizer)
    config = SFTTrainConfig(lr=3e-2, epochs=8, batch_size=2, seed=0)
    metrics = train_sft(model, tokenizer, examples(), config, log=lambda message: None)
    losses = metrics["losses"]
    assert metrics["steps"] == len(losses) == 16 and metrics["examples"] == 4
    assert metrics["final_loss"] == losses[-1] < 0.5 * losses[0]

    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    llm = load_llm("transformers", str(tmp_path / "policy"), batch_size=2)
    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    [[completion]] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    # A 2-layer model after 16 steps writes no sensible answer; that it generates is the point.
    assert isinstance(completion, Completion) and completion.completion_tokens >= 1
