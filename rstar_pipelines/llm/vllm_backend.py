"""In-process generation with vLLM's offline engine (`vllm.LLM`), for GPU machines.

Written against vLLM's documented offline API (`LLM(model=..., **engine_kwargs)`,
`SamplingParams(n, temperature, top_p, max_tokens, stop, seed)`, `LLM.generate`,
`RequestOutput.prompt_token_ids`, `CompletionOutput.text/token_ids/finish_reason/stop_reason`)
and NOT run here: the machine it was written on has no GPU and no vLLM. Only the mapping of vLLM's
outputs to `Completion` (`_to_completion`) is tested, on stand-ins of vLLM's output objects.

With `sparse_attention="seer"` the engine runs SeerAttention-R sparse decoding: the plugin of
`rstar_kernels` (entry point `vllm.general_plugins`) registers it as vLLM's CUSTOM attention
backend, and `seer_engine_options` selects it (block size = the gate's, eager mode) and hands the
gate checkpoint and budget to vLLM's workers through the environment. Also not run here.

vLLM already strips the matched stop string from the text and reports it as `stop_reason`
(None when the completion ended with EOS; an int for a stop token id, which we do not send).

Sampling settings vLLM 0.32.0 refuses are refused here first, with the field named
(`check_vllm_sampling`; the LLM resource calls it before a stage loads the engine): temperature
above 2, and n > 1 with greedy decoding (vLLM's own checks: vllm/sampling_params.py, lines
612-617, 665-670 and 766-770).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .sparse import SeerSettings
from .types import Completion, Prompt, SamplingParams, is_chat, render_chat

# vllm/sampling_params.py: _SAMPLING_EPS (greedy below it) and the temperature range.
VLLM_GREEDY_BELOW = 1e-5
VLLM_MAX_TEMPERATURE = 2.0
VLLM_MAX_N = 16384  # VLLM_MAX_N_SEQUENCES's default (vllm/envs.py)


def check_vllm_sampling(params: SamplingParams) -> None:
    """Raise ValueError, naming the field, for sampling settings vLLM would refuse."""
    if params.temperature > VLLM_MAX_TEMPERATURE:
        raise ValueError(
            f"sampling.temperature={params.temperature}: vLLM accepts temperatures in [0, 2]"
        )
    if params.temperature < VLLM_GREEDY_BELOW and params.n > 1:
        raise ValueError(
            f"sampling.n={params.n} with temperature={params.temperature}: vLLM decodes greedily "
            "below 1e-5 and then refuses n > 1 (the samples would be identical); use n=1 or a "
            "temperature above 0"
        )
    if params.n > VLLM_MAX_N:
        raise ValueError(f"sampling.n={params.n}: vLLM takes at most {VLLM_MAX_N} per request")


class VllmLLM:
    """An LLM running in this process on vLLM; `engine_kwargs` go to `vllm.LLM` as they are."""

    def __init__(
        self,
        model: str,
        *,
        sparse_attention: str | None = None,
        gate_checkpoint: str | None = None,
        token_budget: int | None = None,
        sparse_threshold: float | None = None,
        **engine_kwargs: Any,
    ):
        seer = SeerSettings.from_options(
            sparse_attention, gate_checkpoint, token_budget, sparse_threshold
        )
        if seer is not None:
            tp = engine_kwargs.get("tensor_parallel_size", 1)
            if tp != 1:
                raise ValueError(
                    f"tensor_parallel_size={tp}: the SeerAttention-R vLLM backend runs with "
                    "tensor_parallel_size=1 only (its gates hold every KV head of a layer)"
                )
            engine_kwargs = {**engine_kwargs, **seer_engine_options(seer)}
        import vllm

        self.name = f"vllm:{model}"
        self._vllm = vllm
        self._engine = vllm.LLM(model=model, **engine_kwargs)

    @classmethod
    def over_engine(cls, engine: Any, *, name: str) -> VllmLLM:
        """An LLM over a `vllm.LLM` that already runs, such as the one TRL's GRPOTrainer keeps
        beside the model it trains (colocate mode) and refreshes with its weights."""
        import vllm

        llm = cls.__new__(cls)
        llm.name, llm._vllm, llm._engine = name, vllm, engine
        return llm

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        check_vllm_sampling(params)
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


def seer_engine_options(seer: SeerSettings) -> dict[str, Any]:
    """`vllm.LLM` options for SeerAttention-R decoding; sets the environment that
    `rstar_kernels.vllm_backend` reads in vLLM's worker processes."""
    from rstar_kernels.vllm_plugin import BUDGET_ENV, GATE_ENV, KERNEL_ENV, THRESHOLD_ENV

    os.environ[GATE_ENV] = seer.gate_checkpoint
    for name, value in (
        (BUDGET_ENV, seer.token_budget),
        (THRESHOLD_ENV, seer.threshold),
        (KERNEL_ENV, seer.backend),
    ):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    config = json.loads((Path(seer.gate_checkpoint) / "gate_config.json").read_text())
    return {
        "attention_backend": "CUSTOM",
        "block_size": config["block_size"],
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
