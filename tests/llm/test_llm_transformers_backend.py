"""The transformers backend with the real embedded model (SmolLM2-135M-Instruct, GGUF, on CPU),
with the CPU speed-ups and without them (the plain path): both answer alike."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, StopStringCriteria

from rstar_pipelines.llm import LLM, SamplingParams, transformers_llm_class
from rstar_pipelines.llm.stop_strings import GeneratedTextStopCriteria
from rstar_pipelines.llm.transformers_backend import load_model_and_tokenizer
from rstar_pipelines.llm.types import render_chat

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SAY_HI = [{"role": "user", "content": "Say hi."}]
# Prompts of different lengths, whose greedy answers are known: " Paris." and counting on.
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village far away, there lived a",
]


@pytest.fixture(params=["cpu_speedups", "plain"])
def any_llm(request):
    """The embedded model as it runs by default (int4, with the CPU speed-ups), and plain."""
    name = "embedded_llm" if request.param == "cpu_speedups" else "embedded_plain_llm"
    return request.getfixturevalue(name)


@pytest.fixture(params=["cpu_speedups", "plain"])
def any_fp32_llm(request):
    """The embedded model's float32 weights, with the CPU speed-ups and plain."""
    name = "embedded_fp32_llm" if request.param == "cpu_speedups" else "embedded_plain_llm"
    return request.getfixturevalue(name)


@pytest.fixture(params=[True, False], ids=["cpu_speedups", "plain"])
def llm_class(request):
    """The transformers backend's class with the CPU speed-ups and without."""
    return transformers_llm_class(request.param)


def test_stop_string_is_cut_and_reported(any_llm):
    embedded_llm = any_llm
    [[completion]] = embedded_llm.generate(
        [PROMPTS[0]], GREEDY.model_copy(update={"stop": ("\n", ".")})
    )
    assert completion.text == " Paris"
    assert completion.finish_reason == "stop"
    assert completion.stop_string == "."
    assert completion.prompt_tokens == 5
    assert completion.completion_tokens == 2  # " Paris" and "."


def test_max_tokens_ends_with_length(any_llm):
    embedded_llm = any_llm
    [[completion]] = embedded_llm.generate(
        [PROMPTS[1]], GREEDY.model_copy(update={"max_tokens": 6})
    )
    assert completion.finish_reason == "length"
    assert completion.stop_string is None
    assert completion.completion_tokens == 6
    assert completion.text.startswith(" 5, 6")


def test_chat_prompt_ends_with_eos(any_llm):
    embedded_llm = any_llm
    [[completion]] = embedded_llm.generate([SAY_HI], GREEDY.model_copy(update={"max_tokens": 64}))
    assert completion.finish_reason == "eos"
    assert completion.stop_string is None
    assert "<|im_end|>" not in completion.text and completion.text.strip()
    assert 1 < completion.completion_tokens < 64
    _, tokenizer = load_model_and_tokenizer("embedded")
    assert completion.prompt_tokens == len(
        tokenizer(render_chat(tokenizer, SAY_HI), add_special_tokens=False)["input_ids"]
    )


def test_chat_ending_with_assistant_message_is_continued(any_llm):
    embedded_llm = any_llm
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


def test_n_samples_per_prompt(any_llm):
    embedded_llm = any_llm
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=0)
    results = embedded_llm.generate([*PROMPTS[:2], SAY_HI], params)
    assert [len(samples) for samples in results] == [3, 3, 3]
    assert any(len({c.text for c in samples}) > 1 for samples in results)
    assert all(c.prompt_tokens == samples[0].prompt_tokens for samples in results for c in samples)


def test_greedy_n_repeats_the_one_completion(any_llm):
    embedded_llm = any_llm
    [samples] = embedded_llm.generate(
        [PROMPTS[0]], GREEDY.model_copy(update={"n": 2, "max_tokens": 4})
    )
    assert len(samples) == 2 and samples[0] == samples[1]


def test_same_seed_same_completions(any_llm):
    embedded_llm = any_llm
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=123)
    first = embedded_llm.generate(PROMPTS[:2], params)
    assert embedded_llm.generate(PROMPTS[:2], params) == first
    assert embedded_llm.generate(PROMPTS[:2], params.model_copy(update={"seed": 124})) != first


@pytest.mark.slow
def test_batched_greedy_equals_one_by_one(any_fp32_llm):
    # Left padding plus the attention mask leave each row's computation unchanged but for the
    # last bits (SDPA sums a padded row's keys in another order: about 1e-7 in the first layer's
    # attention), too little to move a greedy choice of these prompts in float32. Quantized
    # weights round every layer's input to bfloat16, which can lift it to a flipped near tie
    # (int4 weights did on the first prompt), hence float32.
    embedded_llm = any_fp32_llm
    params = GREEDY.model_copy(update={"max_tokens": 16})
    batched = embedded_llm.generate([*PROMPTS, SAY_HI], params)
    one_by_one = [embedded_llm.generate([prompt], params)[0] for prompt in [*PROMPTS, SAY_HI]]
    assert batched == one_by_one


def test_a_calls_prompts_are_batched_by_length_and_answered_in_its_order(any_fp32_llm):
    # Eight prompts, long and short in turn, for batches of 4: the four shortest prefill
    # together, padded to the longest of them, not to the call's longest. float32, as above:
    # the answers are each prompt's alone.
    llm = any_fp32_llm
    prompts = [
        PROMPTS[2], "2, 4, 6,", SAY_HI, "The sun is", PROMPTS[2] + " fox", PROMPTS[0],
        "Once upon a time, in a castle by the sea, a", PROMPTS[1],
    ]  # fmt: skip
    lengths = [len(llm._encode(i, p)) for i, p in enumerate(prompts)]
    widths = []
    hook = llm._model.register_forward_hook(
        lambda _, args, kwargs, out: widths.append(kwargs["input_ids"].shape),
        with_kwargs=True,
    )
    params = GREEDY.model_copy(update={"max_tokens": 4})
    try:
        batched = llm.generate(prompts, params)
    finally:
        hook.remove()
    prefills = [shape for shape in widths if shape[1] > 1]
    assert [tuple(s) for s in prefills] == [
        (4, sorted(lengths)[3]), (4, max(lengths))
    ]  # fmt: skip
    assert batched == [llm.generate([prompt], params)[0] for prompt in prompts]


def test_stop_string_is_looked_for_in_generated_text_only():
    _, tokenizer = load_model_and_tokenizer("embedded")
    prompt = tokenizer("Hello\n")["input_ids"]
    generated = tokenizer("\nWorld", add_special_tokens=False)["input_ids"][:1]
    assert tokenizer.decode(generated) == "\n"
    ids = torch.tensor([prompt + generated])
    # transformers' own criterion matches "\n\n" across the prompt boundary; ours does not,
    # like vLLM and OpenAI servers.
    assert StopStringCriteria(tokenizer, ["\n\n"])(ids, None).item()
    assert not GeneratedTextStopCriteria(tokenizer, ["\n\n"], len(prompt))(ids, None).item()
    assert GeneratedTextStopCriteria(tokenizer, ["\n"], len(prompt))(ids, None).item()


def test_stop_strings_are_found_at_the_step_that_completes_them(any_llm):
    embedded_llm = any_llm
    # Decoded a token at a time: stop strings that span tokens, and characters split over
    # several byte tokens (the emoji), are found exactly when the whole text first holds them.
    tokenizer = embedded_llm._tokenizer
    prompt = tokenizer("Q:")["input_ids"]
    texts = ["ab 😀 done<end_of_step> then more", "no stop here at all, 😀 just text"]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    steps = min(len(row) for row in rows)
    stops = ["😀 done<end", "never"]
    criterion = GeneratedTextStopCriteria(tokenizer, stops, len(prompt))
    fired = [
        criterion(torch.tensor([prompt + row[:t] for row in rows]), None).tolist()
        for t in range(1, steps + 1)
    ]
    for row, text_row in enumerate(rows):
        texts_so_far = [tokenizer.decode(text_row[:t]) for t in range(1, steps + 1)]
        expected = [any(s in text for s in stops) for text in texts_so_far]
        assert [step[row] for step in fired] == expected
    assert any(step[0] for step in fired) and not any(step[1] for step in fired)


def test_empty_prompt_is_refused(any_llm):
    embedded_llm = any_llm
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        embedded_llm.generate(["x", ""], GREEDY)


MIXED = [*PROMPTS, SAY_HI]


def test_sampled_copies_honour_stop_strings(any_llm):
    embedded_llm = any_llm
    stops = (".", "\n")
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, stop=stops, seed=0)
    results = embedded_llm.generate(MIXED, params)
    completions = [c for samples in results for c in samples]
    assert [len(samples) for samples in results] == [4] * len(MIXED)
    assert all(not any(s in c.text for s in stops) for c in completions)
    assert all((c.finish_reason == "stop") == (c.stop_string in stops) for c in completions)
    assert sum(c.finish_reason == "stop" for c in completions) > len(completions) // 2


def test_one_token_prompts_sample_n_copies(any_llm):
    embedded_llm = any_llm
    # Nothing to share before the last token: every copy runs its one prompt token.
    [[greedy]] = embedded_llm.generate(["x"], GREEDY.model_copy(update={"max_tokens": 6}))
    assert greedy.prompt_tokens == 1
    params = SamplingParams(n=3, temperature=1e-4, max_tokens=6, seed=0)
    assert embedded_llm.generate(["x"], params) == [[greedy] * 3]


def test_sliding_window_model_samples_n_copies(tmp_path, llm_class):
    # A cache of sliding-window layers is not shared; generate() expands the batch itself.
    _, tokenizer = load_model_and_tokenizer("embedded")
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
        initializer_range=0.5,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = llm_class(str(tmp_path))
    greedy = GREEDY.model_copy(update={"max_tokens": 8})
    expected = llm.generate(PROMPTS, greedy)
    sampled = llm.generate(PROMPTS, greedy.model_copy(update={"temperature": 1e-4, "n": 3}))
    assert sampled == [samples * 3 for samples in expected]
    assert len({samples[0].text for samples in expected}) > 1


def test_wrapped_model_generates_with_its_current_weights_in_eval_mode(tiny_base, llm_class):
    loaded = llm_class(tiny_base)
    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    model.train()
    modes = []
    model.model.layers[0].register_forward_hook(lambda module, *_: modes.append(module.training))
    wrapped = llm_class.wrap(model, loaded._tokenizer, name="trainee", batch_size=2)
    greedy = GREEDY.model_copy(update={"max_tokens": 8})
    before = wrapped.generate(PROMPTS, greedy)
    assert before == loaded.generate(PROMPTS, greedy)  # the same weights as the loaded copy
    assert modes and not any(modes) and model.training  # eval while generating, then put back
    with torch.no_grad():
        model.model.norm.weight.mul_(-1)  # every logit changes sign: argmax becomes argmin
    assert wrapped.generate(PROMPTS, greedy) != before
    assert wrapped.name == "trainee" and isinstance(wrapped, LLM)


def test_loaded_models_run_on_one_thread_whoever_calls_and_wrapped_ones_on_the_callers(
    tiny_base, llm_class
):
    # Two threads running torch's parallel loops make OpenMP throttle its wake-ups (module
    # `torch_thread`): a loaded model's forwards all go to one thread.
    loaded = llm_class(tiny_base)
    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    wrapped = llm_class.wrap(model, loaded._tokenizer, name="trainee", batch_size=2)
    threads: dict[str, set[int]] = {"loaded": set(), "wrapped": set()}
    hooks = [
        llm._model.register_forward_hook(
            lambda *_, key=key: threads[key].add(threading.get_ident())
        )
        for key, llm in (("loaded", loaded), ("wrapped", wrapped))
    ]
    greedy = GREEDY.model_copy(update={"max_tokens": 4})
    callers = []
    try:
        loaded.generate(PROMPTS, greedy)
        with ThreadPoolExecutor(max_workers=2) as pool:
            for _ in range(2):
                pool.submit(loaded.generate, PROMPTS, greedy).result()
                callers.append(pool.submit(threading.get_ident).result())
            pool.submit(wrapped.generate, PROMPTS, greedy).result()
        wrapped.generate(PROMPTS, greedy)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(threads["loaded"]) == 1
    (torch_thread,) = threads["loaded"]
    assert torch_thread != threading.get_ident() and torch_thread not in callers
    assert len(threads["wrapped"]) == 2 and threading.get_ident() in threads["wrapped"]


def test_a_forked_child_runs_on_a_torch_thread_of_its_own():
    from rstar_pipelines.llm import torch_thread

    parent = torch_thread.run(threading.get_ident)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the parent's torch thread is not in the child: it must not wait on it
        os.write(write, b"1" if torch_thread.run(threading.get_ident) else b"0")
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(child, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child waited on its parent's torch thread")
        time.sleep(0.05)
    assert os.read(read, 1) == b"1"
    assert torch_thread.run(threading.get_ident) == parent
