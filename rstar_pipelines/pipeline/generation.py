"""LLM completions for a stage, cached per prompt so a re-run redoes only what changed."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.pipeline.item_cache import ItemCache, fingerprint
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageParams


class LLMStageParams(StageParams):
    model: str  # a role of the pipeline's models section
    sampling: SamplingParams = SamplingParams()
    chunk: int = Field(16, ge=1, description="prompts per LLM batch (and per cache commit)")


class StageLLM:
    """The LLM of a stage's model role: named without loading it (cache keys and row
    provenance need the name), loaded only when a completion is not cached."""

    def __init__(self, stage: Stage, ctx: StageContext):
        resource = ctx.resource("llm")
        self.name = resource.model_id(stage.model)
        self._load = lambda: resource.get_llm(stage.model)

    def complete(
        self, prompts: Sequence[str], sampling: SamplingParams, cache: ItemCache, chunk: int
    ) -> list[list[dict]]:
        """`sampling.n` completions per prompt (each prompt sent as one user message), as
        plain dicts {text, finish_reason, completion_tokens}; `chunk` prompts per batch."""

        def key(prompt: str) -> str:
            return fingerprint("completions", self.name, sampling.model_dump(mode="json"), prompt)

        def compute(batch: list[str]) -> list[list[dict]]:
            outputs = self._load().generate(
                [[{"role": "user", "content": p}] for p in batch], sampling
            )
            return [
                [
                    {
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "completion_tokens": c.completion_tokens,
                    }
                    for c in completions
                ]
                for completions in outputs
            ]

        return cache.map(list(prompts), key, compute, chunk)
