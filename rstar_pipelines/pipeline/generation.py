"""The models a stage generates with: LLM completions cached per prompt (so a re-run redoes only
what changed), and the trained checkpoints (a policy, a PPM) a later stage reads by path.

Every uncached prompt is submitted at once (`rstar_pipelines.llm.types.submit`): the LLM backend
decides how many are in flight (the openai backend fills each server's batch; an in-process model
takes `batch_size` at a time), and each prompt's completions are committed to the item cache as
soon as they are in, so a crash loses only what was in flight and nothing waits for the slowest
completion of a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.types import Completion, submit
from rstar_pipelines.pipeline.item_cache import ItemCache, fingerprint
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageInputError, StageParams


class LLMStageParams(StageParams):
    model: str  # a role of the pipeline's models section
    sampling: SamplingParams = SamplingParams()


class StageLLM:
    """The LLM of a stage's model role: named without loading it (cache keys and row
    provenance need the name), loaded only when a completion is not cached."""

    def __init__(self, stage: Stage, ctx: StageContext):
        resource = ctx.resource("llm")
        self.name = resource.model_id(stage.model)
        self._resource = resource
        self._model = stage.model

    def complete(
        self, prompts: Sequence[str], sampling: SamplingParams, cache: ItemCache
    ) -> list[list[dict]]:
        """`sampling.n` completions per prompt (each prompt sent as one user message), as
        plain dicts {text, finish_reason, completion_tokens}."""

        def key(prompt: str) -> str:
            return fingerprint(self.name, sampling.model_dump(mode="json"), prompt)

        def send(batch: list[str]):
            self._resource.check_sampling(sampling, self._model)
            llm = self._resource.get_llm(self._model)
            return submit(llm, [[{"role": "user", "content": p}] for p in batch], sampling)

        return cache.map_async(list(prompts), key, send, _as_dicts)


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


def _as_dicts(completions: list[Completion]) -> list[dict]:
    return [
        {
            "text": c.text,
            "finish_reason": c.finish_reason,
            "completion_tokens": c.completion_tokens,
        }
        for c in completions
    ]
