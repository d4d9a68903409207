"""The streamed map over a stage's problems: each problem's outcome from the item cache, or
computed with every missing problem in flight at once and committed as soon as it has ended.

The stages that search, roll out or evolve per problem share this shape: the LLM backend
decides how much is in flight, the algorithm reports each problem when it ends with the wall
seconds it took, and a crash loses only what was in flight."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from rstar_pipelines.pipeline.stage import StageContext

T = TypeVar("T")

# finished(j, outcome, seconds): the j-th missing problem has ended
Finished = Callable[[int, dict, float], None]


def map_problems(
    ctx: StageContext,
    problems: Sequence[T],
    key: Callable[[T], str],
    run: Callable[[list[T], Finished], None],
    what: str,
) -> list[dict]:
    """Each problem's outcome, in order: a plain dict with the wall `seconds` its run took.
    `run(missing, finished)` computes the problems the item cache lacks and calls
    `finished(j, outcome, seconds)` from the calling thread as soon as `missing[j]` has ended;
    `key` is a problem's fingerprint in the cache. `what` names the work in the log line."""

    def compute(todo: list[T], done: Callable[[int, dict], None]) -> None:
        start = time.perf_counter()
        run(todo, lambda j, outcome, seconds: done(j, {**outcome, "seconds": seconds}))
        ctx.log.info(f"{what} {len(todo)} problems in {time.perf_counter() - start:.1f}s")

    return ctx.cache.map_streamed(problems, key, compute)
