"""In-process generation with vLLM's offline engine (`vllm.LLM`), for GPU machines.

Written against vLLM's documented offline API (`LLM(model=..., **engine_kwargs)`,
`SamplingParams(n, temperature, top_p, max_tokens, stop, seed)`, `LLM.generate`,
`RequestOutput.prompt_token_ids`, `CompletionOutput.text/token_ids/finish_reason/stop_reason`)
and NOT run here: the machine it was written on has no GPU and no vLLM. Only the mapping of vLLM's
outputs to `Completion` (`_to_completion`) is tested, on stand-ins of vLLM's output objects.

vLLM already strips the matched stop string from the text and reports it as `stop_reason`
(None when the completion ended with EOS; an int for a stop token id, which we do not send).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .types import Completion, Prompt, SamplingParams, is_chat, render_chat


class VllmLLM:
    """An LLM running in this process on vLLM; `engine_kwargs` go to `vllm.LLM` as they are."""

    def __init__(self, model: str, **engine_kwargs: Any):
        import vllm

        self.name = f"vllm:{model}"
        self._vllm = vllm
        self._engine = vllm.LLM(model=model, **engine_kwargs)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=list(params.stop),
            seed=params.seed,
            # Keep special tokens in the text, as the transformers backend does: a trained
            # rStar-Math policy writes its step tags (<end_of_step>, ...) as special tokens.
            skip_special_tokens=False,
        )
        outputs = self._engine.generate(
            [self._prompt(p) for p in prompts], sampling, use_tqdm=False
        )
        return [
            [_to_completion(sample, len(out.prompt_token_ids)) for sample in out.outputs]
            for out in outputs
        ]

    def _prompt(self, prompt: Prompt) -> str | dict[str, list[int]]:
        if not is_chat(prompt):
            return prompt
        tokenizer = self._engine.get_tokenizer()
        # Token ids rather than text: vLLM would add special tokens (a second BOS) to rendered text.
        return {
            "prompt_token_ids": tokenizer.encode(
                render_chat(tokenizer, prompt), add_special_tokens=False
            )
        }


def _to_completion(output: Any, prompt_tokens: int) -> Completion:
    """Map one vLLM `CompletionOutput` to a `Completion`."""
    if output.finish_reason == "length":
        finish, stop_string = "length", None
    elif output.finish_reason == "stop" and isinstance(output.stop_reason, str):
        finish, stop_string = "stop", output.stop_reason
    elif output.finish_reason == "stop":
        finish, stop_string = "eos", None
    else:
        raise RuntimeError(f"vLLM ended a completion with finish_reason={output.finish_reason!r}")
    return Completion(output.text, finish, stop_string, prompt_tokens, len(output.token_ids))
