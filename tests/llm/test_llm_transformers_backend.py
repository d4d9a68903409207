"""The transformers backend with the real embedded model (SmolLM2-135M-Instruct, GGUF, on CPU)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import StopStringCriteria

from rstar_pipelines.llm import LLM, SamplingParams, load_llm
from rstar_pipelines.llm.transformers_backend import _StopOnGeneratedText, load_model_and_tokenizer
from rstar_pipelines.llm.types import render_chat

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SAY_HI = [{"role": "user", "content": "Say hi."}]
# Prompts of different lengths, whose greedy answers are known: " Paris." and counting on.
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village far away, there lived a",
]


def test_is_an_llm_and_loads_once(embedded_llm):
    assert isinstance(embedded_llm, LLM)
    assert embedded_llm.name == "transformers:embedded"
    started = time.monotonic()
    again = load_llm("transformers")
    assert time.monotonic() - started < 1.0
    assert again._model is embedded_llm._model


def test_stop_string_is_cut_and_reported(embedded_llm):
    [[completion]] = embedded_llm.generate(
        [PROMPTS[0]], GREEDY.model_copy(update={"stop": ("\n", ".")})
    )
    assert completion.text == " Paris"
    assert completion.finish_reason == "stop"
    assert completion.stop_string == "."
    assert completion.prompt_tokens == 5
    assert completion.completion_tokens == 2  # " Paris" and "."


def test_max_tokens_ends_with_length(embedded_llm):
    [[completion]] = embedded_llm.generate(
        [PROMPTS[1]], GREEDY.model_copy(update={"max_tokens": 6})
    )
    assert completion.finish_reason == "length"
    assert completion.stop_string is None
    assert completion.completion_tokens == 6
    assert completion.text.startswith(" 5, 6")


def test_chat_prompt_ends_with_eos(embedded_llm):
    [[completion]] = embedded_llm.generate([SAY_HI], GREEDY.model_copy(update={"max_tokens": 64}))
    assert completion.finish_reason == "eos"
    assert completion.stop_string is None
    assert "<|im_end|>" not in completion.text and completion.text.strip()
    assert 1 < completion.completion_tokens < 64
    _, tokenizer = load_model_and_tokenizer("embedded")
    assert completion.prompt_tokens == len(
        tokenizer(render_chat(tokenizer, SAY_HI), add_special_tokens=False)["input_ids"]
    )


def test_chat_ending_with_assistant_message_is_continued(embedded_llm):
    _, tokenizer = load_model_and_tokenizer("embedded")
    conversation = [*SAY_HI, {"role": "assistant", "content": "Hello"}]
    rendered = render_chat(tokenizer, conversation)
    assert rendered.endswith("<|im_start|>assistant\nHello")
    [[completion]] = embedded_llm.generate(
        [conversation], GREEDY.model_copy(update={"max_tokens": 8})
    )
    assert completion.prompt_tokens == len(
        tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    assert not completion.text.startswith("<|im_start|>")


def test_n_samples_per_prompt(embedded_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=0)
    results = embedded_llm.generate([*PROMPTS[:2], SAY_HI], params)
    assert [len(samples) for samples in results] == [3, 3, 3]
    assert any(len({c.text for c in samples}) > 1 for samples in results)
    assert all(c.prompt_tokens == samples[0].prompt_tokens for samples in results for c in samples)


def test_greedy_n_repeats_the_one_completion(embedded_llm):
    [samples] = embedded_llm.generate(
        [PROMPTS[0]], GREEDY.model_copy(update={"n": 2, "max_tokens": 4})
    )
    assert len(samples) == 2 and samples[0] == samples[1]


def test_same_seed_same_completions(embedded_llm):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=123)
    first = embedded_llm.generate(PROMPTS[:2], params)
    assert embedded_llm.generate(PROMPTS[:2], params) == first
    assert embedded_llm.generate(PROMPTS[:2], params.model_copy(update={"seed": 124})) != first


def test_batched_greedy_equals_one_by_one(embedded_llm):
    # Left padding plus the attention mask leave each row's computation unchanged, and on this CPU
    # the float32 results come out bit-identical for these prompts, so greedy texts match exactly.
    params = GREEDY.model_copy(update={"max_tokens": 16})
    batched = embedded_llm.generate([*PROMPTS, SAY_HI], params)
    one_by_one = [embedded_llm.generate([prompt], params)[0] for prompt in [*PROMPTS, SAY_HI]]
    assert batched == one_by_one


def test_stop_string_is_looked_for_in_generated_text_only():
    _, tokenizer = load_model_and_tokenizer("embedded")
    prompt = tokenizer("Hello\n")["input_ids"]
    generated = tokenizer("\nWorld", add_special_tokens=False)["input_ids"][:1]
    assert tokenizer.decode(generated) == "\n"
    ids = torch.tensor([prompt + generated])
    # transformers' own criterion matches "\n\n" across the prompt boundary; ours does not,
    # like vLLM and OpenAI servers.
    assert StopStringCriteria(tokenizer, ["\n\n"])(ids, None).item()
    assert not _StopOnGeneratedText(tokenizer, ["\n\n"], len(prompt))(ids, None).item()
    assert _StopOnGeneratedText(tokenizer, ["\n"], len(prompt))(ids, None).item()


def test_empty_prompt_is_refused(embedded_llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        embedded_llm.generate(["x", ""], GREEDY)
