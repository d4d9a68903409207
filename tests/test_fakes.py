"""The scripted LLMs keep to the LLM protocols the pipeline checks for, so a change to them shows
here first."""

from __future__ import annotations

from rstar_pipelines.llm import LLM, Completion, SamplingParams
from rstar_pipelines.llm.types import AsyncLLM, serves_each_request, stream
from tests.fakes.llm import ArrivingLLM, ScriptedLLM, StreamingLLM, completion


def echo(prompt, params):
    return [f"{prompt}!", f"{prompt}?"]


def test_scripted_llms_are_llms_and_only_the_fleets_are_async():
    llm = ScriptedLLM(echo)
    assert isinstance(llm, LLM) and not isinstance(llm, AsyncLLM)
    for fleet in (StreamingLLM(llm, delay_s=0.0), ArrivingLLM(llm, order=lambda n: 0)):
        assert isinstance(fleet, AsyncLLM) and serves_each_request(fleet)


def test_cycle_gives_n_and_calls_are_recorded():
    llm = ScriptedLLM(echo, cycle=True, tokens=3, batch_size=2)
    out = llm.generate(["a", "b"], SamplingParams(n=3))
    assert [[c.text for c in cs] for cs in out] == [["a!", "a?", "a!"], ["b!", "b?", "b!"]]
    assert (llm.prompts, llm.batches, llm.generated, llm.batch_size) == (2, [2], 18, 2)
    # Without cycle every scripted completion, whatever n; through the batcher as well.
    plain = ScriptedLLM(echo)
    assert [len(cs) for _, cs in stream(plain, ["x"], SamplingParams(n=1))] == [2]


def test_completion_cuts_stops_and_length():
    assert completion("ab<end>", stops=("<end>",)) == Completion("ab", "stop", "<end>", 10, 7)
    assert completion("abcdef", max_tokens=4, prompt_tokens=0) == Completion(
        "abcd", "length", None, 0, 4
    )
    assert completion("ab", tokens=5) == Completion("ab", "eos", None, 10, 5)
