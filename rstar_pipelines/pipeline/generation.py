"""The models a stage generates with: LLM completions cached per prompt (so a re-run redoes only
what changed), and the trained checkpoints (a policy, a PPM) a later stage reads by path."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.pipeline.item_cache import ItemCache, fingerprint
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageInputError, StageParams


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
            return fingerprint(self.name, sampling.model_dump(mode="json"), prompt)

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


def checkpoint_path(inputs: dict[str, pa.Table], name: str) -> str | None:
    """The path in the last row of checkpoint table `name`; None when the stage has no such
    input (round 1 has no previous round)."""
    if name not in inputs:
        return None
    rows = inputs[name].to_pylist()
    if not rows:
        raise StageInputError(f"{name} has no checkpoint row: train it first")
    return rows[-1]["path"]


class CheckpointModels:
    """The policy (and PPM) a stage generates with: a checkpoint's path when there is one (a
    later round, or an evaluation), else the stage's declared model; no PPM without a path.
    Named without loading anything (cache keys and row provenance need the names)."""

    def __init__(
        self, stage: Stage, ctx: StageContext, policy_path: str | None, ppm_path: str | None
    ):
        resource = ctx.resource("llm")
        policy = policy_path or stage.model
        self.ppm_path = ppm_path
        self.policy_name = resource.model_id(policy)
        self._policy = lambda: resource.get_llm(policy)

    def policy(self):
        return self._policy()

    def ppm(self):
        if self.ppm_path is None:
            return None
        from rstar_pipelines.llm.value_model import ProcessPreferenceModel

        return ProcessPreferenceModel.load(self.ppm_path)
