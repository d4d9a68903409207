"""eval_comparison: the evaluated methods side by side on the held-out math problems they
share (greedy decoding, PPM-guided search, a majority vote over n samples, DSER), with what
each cost."""

from __future__ import annotations

import time

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.dser.evolve import ChainState, DSERProblem, Judge, extract_answer
from rstar_pipelines.dser.stages import dser_prompts, mean
from rstar_pipelines.dser.vote import vote
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.math.search_stages import SearchModels, checkpoint_path, verified_math_problems
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import labelled_points, markdown_table
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.storage import schemas


class ComparisonParams(StageParams):
    round: int = Field(1, ge=1)
    sampling: SamplingParams = Field(
        SamplingParams(n=8, temperature=0.7),
        description="the majority-vote baseline: n samples of the first-solution prompt",
    )
    chunk: int = Field(8, ge=1, description="problems sampled together (and per cache commit)")


class EvaluationComparison(Stage):
    """The round's policy four ways on the held-out math problems mcts_eval and dser_eval
    share: greedy decoding and PPM-guided search (from mcts_eval), a plurality vote over
    n samples of DSER's first-solution prompt (sampled here), and DSER (from dser_eval);
    each with its accuracy and the tokens and seconds it spent per problem."""

    Params = ComparisonParams
    schema = schemas.EVAL_COMPARISON
    prompt_roles = ("solve", "verify", "refine")  # DSER's: its first solutions are sampled
    resources = ("llm",)

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        models = SearchModels(self, ctx, checkpoint_path(inputs, "policy_checkpoint"), None)
        mcts = _evaluated(inputs, "mcts_eval", models.policy_name)
        dser = {
            (r["batch"], r["problem_id"]): r
            for r in _evaluated(inputs, "dser_eval", models.policy_name)
            if r["domain"] == "math"
        }
        shared = [r for r in mcts if (r["batch"], r["problem_id"]) in dser]
        if not shared:
            raise StageInputError(
                f"eval_comparison: mcts_eval ({len(mcts)} problems) and dser_eval "
                f"({len(dser)} math problems) share no problem: evaluate both on the same "
                f"held-out split (same heldout_fraction and max_problems)"
            )
        questions = {(q["batch"], q["id"]): q["question"] for q in verified_math_problems(inputs)}
        missing = [
            r["problem_id"] for r in shared if (r["batch"], r["problem_id"]) not in questions
        ]
        if missing:
            raise StageInputError(
                f"eval_comparison: problems {missing} of mcts_eval are not verified math "
                f"problems of verified_outputs any more: re-materialize the evaluations"
            )
        problems = [
            DSERProblem(
                r["problem_id"], "math", questions[(r["batch"], r["problem_id"])], r["gold_answer"]
            )
            for r in shared
        ]
        majority = self._majority_of_n(ctx, models, problems)
        dser_rows = [dser[(r["batch"], r["problem_id"])] for r in shared]
        methods = [
            (
                "greedy",
                [(r["greedy_correct"], r["greedy_tokens"], r["greedy_seconds"]) for r in shared],
            ),
            (
                "mcts_best_q",
                [(r["best_q_correct"], r["search_tokens"], r["search_seconds"]) for r in shared],
            ),
            (f"majority_of_{p.sampling.n}", majority),
            ("dser", [(r["vote_correct"], r["tokens"], r["seconds"]) for r in dser_rows]),
        ]
        rows = [
            {
                "round": p.round,
                "method": name,
                "problems": len(outcomes),
                "accuracy": mean(bool(c) for c, _, _ in outcomes),
                "tokens_per_problem": mean(t for _, t, _ in outcomes),
                "seconds_per_problem": mean(s for _, _, s in outcomes),
                "policy": models.policy_name,
            }
            for name, outcomes in methods
        ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(shared),
                "policy": models.policy_name,
                **{f"accuracy_{r['method']}": r["accuracy"] for r in rows},
                "comparison": markdown_table(
                    ["method", "problems", "accuracy", "tokens/problem", "seconds/problem"],
                    [
                        [
                            r["method"],
                            r["problems"],
                            f"{r['accuracy']:.3f}",
                            f"{r['tokens_per_problem']:.0f}",
                            f"{r['seconds_per_problem']:.2f}",
                        ]
                        for r in rows
                    ],
                ),
                "accuracy_vs_tokens": labelled_points(
                    [(r["method"], r["tokens_per_problem"], r["accuracy"]) for r in rows],
                    "accuracy against tokens spent",
                    "tokens per problem",
                    "accuracy",
                ),
            },
        )

    def _majority_of_n(
        self, ctx: StageContext, models: SearchModels, problems: list[DSERProblem]
    ) -> list[tuple[bool, int, float]]:
        """Per problem: whether the plurality of n samples is right, their tokens, seconds."""
        sampling = self.params.sampling
        solve = dser_prompts(self).solve

        def key(problem: DSERProblem) -> str:
            return fingerprint(
                "majority-of-n",
                models.policy_name,
                sampling.model_dump(mode="json"),
                solve(problem),
            )

        def compute(chunk: list[DSERProblem]) -> list[dict]:
            llm = models.policy()
            start = time.perf_counter()
            outputs = llm.generate(
                [[{"role": "user", "content": solve(q)}] for q in chunk], sampling
            )
            seconds = (time.perf_counter() - start) / len(chunk)
            return [
                {
                    "texts": [c.text for c in completions],
                    "tokens": sum(c.completion_tokens for c in completions),
                    "seconds": seconds,
                }
                for completions in outputs
            ]

        stored = ctx.cache.map(problems, key, compute, self.params.chunk)
        judge = Judge()
        outcomes = []
        for problem, sampled in zip(problems, stored, strict=True):
            answers = [extract_answer("math", text) for text in sampled["texts"]]
            grades = judge.grade([(problem, a) for a in answers])
            states = [
                ChainState(0, text, answer, None, grade.correct, 0)
                for text, answer, grade in zip(sampled["texts"], answers, grades, strict=True)
            ]
            outcomes.append((vote(states, "math").correct, sampled["tokens"], sampled["seconds"]))
        return outcomes


def _evaluated(inputs: dict[str, pa.Table], name: str, policy: str) -> list[dict]:
    """An evaluation's rows, all of this round's policy (else they are stale)."""
    rows = rows_of(inputs[name])
    other = sorted({r["policy"] for r in rows} - {policy})
    if other:
        raise StageInputError(
            f"eval_comparison: {name} evaluated {other}, not this round's policy {policy}: "
            f"re-materialize {name}"
        )
    return rows
