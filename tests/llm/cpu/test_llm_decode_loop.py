"""The transformers backend's decode loop (module `decode_loop`) with the real embedded model:
rows that end leave the batch without changing anything, it decodes as `generate()` does, and
every sampled row draws from a stream of its own."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu import decode_loop
from rstar_pipelines.llm.cpu.decode_loop import TokenPicker

# Completions that end at different steps: stop strings, EOS after a chat turn, max_tokens.
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    [{"role": "user", "content": "Say hi."}],
    "Once upon a time, in a small village far away, there lived a",
]  # one batch of the fixtures' batch_size
STOPS = (".", "\n\n")


def rows_per_step(llm, params: SamplingParams) -> tuple[list, list[int]]:
    """The completions of PROMPTS, and the rows of every forward of the model after the first."""
    rows = []
    hook = llm._model.register_forward_hook(
        lambda _, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        return llm.generate(PROMPTS, params), rows[1:]
    finally:
        hook.remove()


def test_rows_that_end_leave_the_batch_and_change_no_completion(embedded_llm, monkeypatch):
    for params in (
        SamplingParams(temperature=0, max_tokens=24, stop=STOPS),
        SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=24, stop=STOPS, seed=7),
    ):
        dropped, dropped_rows = rows_per_step(embedded_llm, params)
        monkeypatch.setattr(decode_loop, "DROP_SHARE", 2.0)  # never drop
        kept, kept_rows = rows_per_step(embedded_llm, params)
        monkeypatch.undo()
        assert dropped == kept
        copies = params.n if params.temperature else 1
        assert set(kept_rows) == {len(PROMPTS) * copies}
        assert dropped_rows[-1] < len(PROMPTS) * copies  # the batch shrank as rows ended
        assert len({c.finish_reason for samples in kept for c in samples}) > 1


def test_greedy_decoding_equals_generate(embedded_fp32_llm, monkeypatch):
    # float32: the same kernels either way, so the tokens must be identical.
    llm = embedded_fp32_llm
    params = SamplingParams(temperature=0, max_tokens=24, stop=STOPS)
    ours = llm.generate(PROMPTS, params)
    monkeypatch.setattr(llm, "_new_cache", lambda capacity: None)  # generate()'s path
    assert llm.generate(PROMPTS, params) == ours


def test_a_prompt_samples_the_same_alone_as_in_any_batch(embedded_fp32_llm):
    # Each row's draws are its own. float32: the logits of a row alone and in a padded batch are
    # then equal to float precision; int8's bfloat16 activations round them apart by up to 0.1,
    # which moves some draws across a boundary.
    embedded_llm = embedded_fp32_llm
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=3)
    together = embedded_llm.generate(PROMPTS, params)
    for i in (1, 2):
        assert embedded_llm.generate([PROMPTS[i]], params) == [together[i]]
    # The same prompt twice in one call draws two sets of samples, the first as if alone.
    twice = embedded_llm.generate([PROMPTS[3], PROMPTS[3]], params)
    assert twice[0] == together[3] and twice[1] != twice[0]
    assert embedded_llm.generate([PROMPTS[3]], params.model_copy(update={"seed": 4})) != [
        together[3]
    ]


def test_sampling_draws_from_generates_distribution(embedded_fp32_llm):
    model = embedded_fp32_llm._model
    vocab = model.config.vocab_size
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 4
    history = torch.zeros(6, 3, dtype=torch.long)
    for temperature, top_p in ((0.7, 0.9), (1.0, 1.0), (1.3, 0.5)):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=8)
        config = embedded_fp32_llm._generation_config(params)
        assert config.top_k == 50  # generate()'s default, which sampling has always used
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(50)])
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        expected = warpers(history, logits.clone()).softmax(dim=-1)
        picker = TokenPicker(model, config, prompt_width=3, device="cpu")
        probs, candidates = picker.distribution(history, logits.clone())
        got = torch.zeros_like(expected).scatter(-1, candidates, probs / probs.sum(-1, True))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # Draws land only on tokens with mass, and a uniform's place in the mass picks the token.
        uniforms = torch.rand(6, generator=torch.Generator().manual_seed(1))
        drawn = picker(history, logits.clone(), uniforms)
        assert bool((expected.gather(-1, drawn) > 0).all())
        first = picker(history, logits.clone(), torch.zeros(6))
        assert torch.equal(first[:, 0], expected.argmax(dim=-1))


def test_a_shared_preamble_runs_once_and_changes_no_completion(embedded_fp32_llm):
    # float32: the preamble computed once for the batch and each prompt run alone agree to
    # float precision, so greedy completions are identical.
    llm = embedded_fp32_llm
    preamble = "You solve problems step by step. " * 6  # well over MIN_SHARED_PREFIX tokens
    prompts = [preamble + q for q in ("What is 2 + 3?", "Name a color.", "Count to five:")]
    assert decode_loop.shared_prefix_length([_ids(llm, p) for p in prompts]) >= 32
    llm.prefix_cache.clear()  # nothing stored by earlier tests: the preamble is computed here
    seen = []
    hook = llm._model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    params = SamplingParams(temperature=0, max_tokens=12)
    try:
        together = llm.generate(prompts, params)
    finally:
        hook.remove()
    prefix = decode_loop.shared_prefix_length([_ids(llm, p) for p in prompts])
    assert seen[0] == (1, prefix)  # the preamble once, then each prompt's rest
    assert seen[1][0] == len(prompts) and seen[1][1] < max(len(_ids(llm, p)) for p in prompts)
    assert together == [llm.generate([p], params)[0] for p in prompts]
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5)
    assert llm.generate(prompts, sampled)[1] == llm.generate([prompts[1]], sampled)[0]


def test_a_prompt_that_extends_an_earlier_one_computes_only_its_new_tokens(embedded_fp32_llm):
    # An MCTS expansion: the next prompt is the last one plus a step. float32, so the prefix
    # taken from the store and the one computed whole agree to float precision.
    llm = embedded_fp32_llm
    store = llm.prefix_cache
    first = "Solve step by step. Question: a farmer has 12 cows and buys 7 more. " * 3
    second = first + "Step 1: he had 12 cows. Step 2:"
    greedy = SamplingParams(temperature=0, max_tokens=10)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3)
    store.clear()
    alone = [llm.generate([second], p) for p in (greedy, sampled)]
    store.clear()
    llm.generate([first], greedy)
    assert len(store) == 1
    seen = []
    hook = llm._model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        after = llm.generate([second], greedy)
    finally:
        hook.remove()
    ids = _ids(llm, second)
    reused = len(_ids(llm, first)) - 1  # the first call stored its prompt but the last token
    assert reused >= decode_loop.MIN_SHARED_PREFIX
    assert seen == [len(ids) - 1 - reused, *[1] * (len(seen) - 1)]  # only the new tokens
    assert [after, llm.generate([second], sampled)] == alone
    assert len(store) == 1  # the longer prompt replaced the one it extends


def test_a_model_being_trained_keeps_no_prefixes(tiny_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    llm = CpuTransformersLLM.wrap(model, tokenizer, name="trained")
    prompt = "one two three four five six seven eight nine ten " * 6
    greedy = SamplingParams(temperature=0, max_tokens=6)
    llm.generate([prompt], greedy)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.0)  # an optimizer step, a large one
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    fresh = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    assert llm.prefix_cache is None
    assert llm.generate([prompt], greedy)[0][0].text == tokenizer.decode(fresh)


def _ids(llm, prompt: str) -> list[int]:
    return llm._encode(0, prompt)
