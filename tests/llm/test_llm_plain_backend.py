"""The transformers backend with the CPU speed-ups switched off: transformers' own generate() on
the weights as loaded, named apart, refusing the speed-ups' settings, and loading none of the
`cpu` package's code (no quantized layer, no C kernel, no private API)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rstar_pipelines.llm import SamplingParams, cpu_speedups, load_llm
from rstar_pipelines.llm.resource import LLMResource
from tests.fakes.llm import TRANSFORMERS

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_plain_path_generates_with_the_weights_as_loaded(embedded_plain_llm):
    llm = embedded_plain_llm
    assert llm.name == f"{TRANSFORMERS}:embedded+plain"
    model = llm._model
    assert model.config._attn_implementation == "sdpa"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    room = [m for m in model.modules() if type(m).__module__.startswith("rstar_pipelines.llm.cpu")]
    assert room == []
    [[completion]] = llm.generate(["The capital of France is"], GREEDY)
    assert completion.text.startswith(" Paris")


def test_speedups_settings_are_refused_when_switched_off():
    with pytest.raises(ValueError, match="quantization='int4' is one of the CPU speed-ups"):
        load_llm("transformers", "embedded", cpu_speedups=False, quantization="int4")
    resource = LLMResource(cpu_speedups=False, quantization="int8")
    with pytest.raises(ValueError, match="CPU speed-ups, which are switched off"):
        resource.model_id()


def test_the_switch_reads_its_environment_variable(monkeypatch):
    monkeypatch.delenv("RSTAR_LLM_QUANTIZATION", raising=False)
    monkeypatch.setenv("RSTAR_LLM_CPU_SPEEDUPS", "off")
    assert not cpu_speedups()
    assert cpu_speedups(True)
    assert LLMResource().model_id() == f"{TRANSFORMERS}:embedded+plain"
    assert LLMResource(cpu_speedups=True, device="cpu").model_id().endswith("embedded+int4")
    monkeypatch.setenv("RSTAR_LLM_CPU_SPEEDUPS", "sometimes")
    with pytest.raises(ValueError, match="RSTAR_LLM_CPU_SPEEDUPS must be on or off"):
        cpu_speedups()
    monkeypatch.delenv("RSTAR_LLM_CPU_SPEEDUPS")
    assert cpu_speedups()


def test_a_process_with_the_speedups_off_loads_none_of_their_code():
    # A fresh process: this one has imported the speed-ups for other tests.
    script = textwrap.dedent(
        """
        import sys
        from rstar_pipelines.llm import SamplingParams
        from rstar_pipelines.llm.resource import LLMResource

        llm = LLMResource(device="cpu").get_llm()
        params = SamplingParams(temperature=0, max_tokens=4)
        [[completion]] = llm.generate(["The capital of France is"], params)
        print(repr(completion.text))
        print(sorted(m for m in sys.modules if m.startswith("rstar_pipelines.llm.cpu")))
        """
    )
    env = {**os.environ, "RSTAR_LLM_CPU_SPEEDUPS": "off"}
    env.pop("RSTAR_LLM_QUANTIZATION", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text, modules = done.stdout.strip().splitlines()[-2:]
    assert text.startswith("' Paris")
    # The switch's settings alone (no torch): the package and its scheme names.
    assert modules == "['rstar_pipelines.llm.cpu', 'rstar_pipelines.llm.cpu.quantization']"
