"""The transformers backend with the CPU speed-ups (`cpu.backend.CpuTransformersLLM`), on the
real embedded model: its name, one load per process, and what its decode loop shares (one
prefill for a prompt's copies) and keeps exact (logits, near-greedy samples)."""

from __future__ import annotations

import time

import torch

from rstar_pipelines.llm import LLM, SamplingParams, load_llm
from rstar_pipelines.llm.cpu.backend import load_model_and_tokenizer
from rstar_pipelines.llm.types import render_chat
from tests.fakes.llm import TRANSFORMERS

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SAY_HI = [{"role": "user", "content": "Say hi."}]
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village far away, there lived a",
]


def test_is_an_llm_and_loads_once(embedded_llm):
    assert isinstance(embedded_llm, LLM)
    assert embedded_llm.name == f"{TRANSFORMERS}:embedded+int4"
    started = time.monotonic()
    again = load_llm("transformers")
    assert time.monotonic() - started < 1.0
    assert again._model is embedded_llm._model


# Sampling n completions per prompt prefills each prompt once and copies its cache n times.
MIXED = [*PROMPTS, SAY_HI]


def _prompt_ids(prompt) -> list[int]:
    _, tokenizer = load_model_and_tokenizer("embedded")
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return tokenizer(render_chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]


def test_sampled_copies_share_one_prefill(embedded_llm):
    lengths = []
    decoder = embedded_llm._model.get_decoder()
    hook = decoder.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        params = SamplingParams(n=3, temperature=1.0, max_tokens=3, seed=0)
        results = embedded_llm.generate(MIXED, params)
    finally:
        hook.remove()
    width = max(len(_prompt_ids(prompt)) for prompt in MIXED)
    # The prompts once, all but their last token; then every copy one token at a time (fewer
    # once some have ended and left the batch).
    assert lengths[0] == (len(MIXED), width - 1)
    assert lengths[1] == (3 * len(MIXED), 1)
    assert all(rows <= 3 * len(MIXED) and tokens == 1 for rows, tokens in lengths[2:])
    assert [len(samples) for samples in results] == [3] * len(MIXED)


def test_sampling_logits_equal_a_plain_forward_per_prompt(embedded_fp32_llm):
    # float32 weights: with quantized ones the bfloat16 activations round the tiny float differences
    # between a cached, padded step and a plain forward up to about 0.1 in the logits.
    embedded_llm = embedded_fp32_llm
    model = embedded_llm._model
    steps = []  # (input ids, last logits) of every forward of the model
    hook = model.register_forward_hook(
        lambda _, args, kwargs, out: steps.append((kwargs["input_ids"], out.logits[:, -1])),
        with_kwargs=True,
    )
    n = 2
    try:
        embedded_llm.generate(MIXED, SamplingParams(n=n, temperature=1.0, max_tokens=2, seed=0))
    finally:
        hook.remove()
    prompts = [_prompt_ids(prompt) for prompt in MIXED]
    assert len(steps) == 2  # the prompts' last token for every copy, then its sampled token
    sampled = steps[1][0][:, 0].tolist()
    # The first two steps of every copy, against each prompt (plus its sampled token) run alone,
    # unpadded and uncached.
    for step in range(2):
        for row in range(len(prompts) * n):
            ids = prompts[row // n] + sampled[row : row + 1][:step]
            with torch.inference_mode():
                expected = model(input_ids=torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(steps[step][1][row], expected, rtol=1e-4, atol=1e-4)


def test_near_zero_temperature_samples_equal_greedy(embedded_fp32_llm):
    # A left-padded batch of different lengths, with stop strings that end some completions.
    # float32 weights: the shared prefill computes the prompt in two parts, and with quantized
    # weights the bfloat16 activations can round that differently enough to flip a near tie.
    embedded_llm = embedded_fp32_llm
    greedy = GREEDY.model_copy(update={"max_tokens": 16, "stop": (".", "\n\n")})
    expected = embedded_llm.generate(MIXED, greedy)
    sampled = embedded_llm.generate(
        MIXED, greedy.model_copy(update={"temperature": 1e-4, "n": 3, "seed": 0})
    )
    assert sampled == [samples * 3 for samples in expected]
    assert any(samples[0].finish_reason == "stop" for samples in expected)
