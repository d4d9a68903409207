"""How vLLM's output objects map to Completion (vLLM itself does not run here: no GPU)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from rstar_pipelines.llm import Completion
from rstar_pipelines.llm.vllm_backend import _to_completion


def vllm_output(finish_reason, stop_reason=None, text="abc", token_ids=(1, 2, 3)):
    """Stand-in for vllm.outputs.CompletionOutput: only the fields the mapping reads."""
    return SimpleNamespace(
        text=text, token_ids=list(token_ids), finish_reason=finish_reason, stop_reason=stop_reason
    )


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (vllm_output("length"), Completion("abc", "length", None, 7, 3)),
        (vllm_output("stop", "\n\n"), Completion("abc", "stop", "\n\n", 7, 3)),
        (vllm_output("stop", None), Completion("abc", "eos", None, 7, 3)),
        (vllm_output("stop", 128009), Completion("abc", "eos", None, 7, 3)),  # a stop token id
    ],
)
def test_output_mapping(output, expected):
    assert _to_completion(output, prompt_tokens=7) == expected


def test_aborted_output_is_an_error():
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        _to_completion(vllm_output("abort"), prompt_tokens=7)


def test_seer_engine_options(tmp_path, monkeypatch):
    from importlib.metadata import entry_points

    from rstar_pipelines.llm.sparse import SeerSettings
    from rstar_pipelines.llm.vllm_backend import seer_engine_options

    names = ("RSTAR_GATE_CHECKPOINT", "RSTAR_SEER_TOKEN_BUDGET", "RSTAR_SEER_THRESHOLD")
    for name in (*names, "RSTAR_SEER_KERNEL"):
        # setenv first, so that monkeypatch restores (removes) what the options set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp_path / "gate_config.json").write_text('{"block_size": 32}')
    options = seer_engine_options(SeerSettings(str(tmp_path), token_budget=2048))
    assert options == {"attention_backend": "CUSTOM", "block_size": 32}
    assert os.environ["RSTAR_GATE_CHECKPOINT"] == str(tmp_path.resolve())
    assert os.environ["RSTAR_SEER_TOKEN_BUDGET"] == "2048"
    assert "RSTAR_SEER_THRESHOLD" not in os.environ
    # vLLM finds the plugin through the installed package's entry point.
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rstar_seer"]
    assert plugin.value == "rstar_kernels.vllm_plugin:register"
    assert callable(plugin.load())


def test_sparse_decoding_refuses_tensor_parallelism_before_vllm_is_imported(tmp_path):
    from rstar_pipelines.llm.vllm_backend import VllmLLM

    (tmp_path / "gate_config.json").write_text('{"block_size": 64}')
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the SeerAttention-R"):
        VllmLLM("m", sparse_attention="seer", gate_checkpoint=str(tmp_path), tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 2.5}, "temperature=2.5: vLLM accepts temperatures in \\[0, 2\\]"),
        ({"n": 2, "temperature": 0}, "sampling.n=2 with temperature=0"),
        ({"n": 2, "temperature": 5e-6}, "sampling.n=2 with temperature=5e-06"),
    ],
)
def test_sampling_vllm_refuses(params, message):
    from rstar_pipelines.llm import SamplingParams
    from rstar_pipelines.llm.vllm_backend import check_vllm_sampling

    with pytest.raises(ValueError, match=message):
        check_vllm_sampling(SamplingParams(**params))
    check_vllm_sampling(SamplingParams(n=2, temperature=2.0))
