"""How vLLM's output objects map to Completion (vLLM itself does not run here: no GPU)."""

from __future__ import annotations

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
