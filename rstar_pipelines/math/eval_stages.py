"""mcts_eval: PPM-guided search against greedy decoding, on held-out problems."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.math.answers import equivalent
from rstar_pipelines.math.evaluation import best_q_answer, greedy_config, top_answers_vote
from rstar_pipelines.math.search_stages import (
    SearchModels,
    SearchStage,
    SearchStageParams,
    checkpoint_path,
    search_problems,
    search_trees,
)
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import StageContext, StageResult
from rstar_pipelines.storage import schemas


class EvalParams(SearchStageParams):
    prompt: Literal["bootstrap", "policy"] = "policy"
    top_answers: int = Field(4, ge=1, description="highest-Q answers the vote is over")


def _correct(answer: str | None, gold: str) -> bool:
    return answer is not None and equivalent(answer, gold)


def _mean(rows: list[dict], column: str) -> float:
    return sum(r[column] for r in rows) / len(rows) if rows else 0.0


class MCTSEvaluation(SearchStage):
    """On the held-out split of verified math problems, this round's policy three ways:
    greedy decoding, PPM-guided search answered by the best-Q leaf, and a majority vote
    over the search's top answers."""

    Params = EvalParams
    schema = schemas.MCTS_EVAL

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        problems = search_problems(inputs, p, heldout=True)
        guided = SearchModels(
            self,
            ctx,
            checkpoint_path(inputs, "policy_checkpoint"),
            checkpoint_path(inputs, "ppm_checkpoint"),
        )
        plain = SearchModels(self, ctx, checkpoint_path(inputs, "policy_checkpoint"), None)
        greedy, greedy_seconds, _ = search_trees(
            self, ctx, problems, plain, greedy_config(p.search)
        )
        searched, search_seconds, stats = search_trees(self, ctx, problems, guided, p.search)
        rows = []
        for problem, g, s, g_s, s_s in zip(
            problems, greedy, searched, greedy_seconds, search_seconds, strict=True
        ):
            answers = {
                "greedy": best_q_answer(g),
                "best_q": best_q_answer(s),
                "majority": top_answers_vote(s, p.top_answers),
            }
            rows.append(
                {
                    "problem_id": problem["id"],
                    "batch": problem["batch"],
                    "round": p.round,
                    "gold_answer": problem["answer"],
                    **{f"{k}_answer": v for k, v in answers.items()},
                    **{f"{k}_correct": _correct(v, problem["answer"]) for k, v in answers.items()},
                    "search_nodes": s.nodes.num_rows,
                    "greedy_tokens": g.completion_tokens,
                    "search_tokens": s.completion_tokens,
                    "greedy_seconds": g_s,
                    "search_seconds": s_s,
                    "policy": guided.policy_name,
                }
            )
        n = len(rows)
        accuracy = {
            k: (sum(r[f"{k}_correct"] for r in rows) / n if n else 0.0)
            for k in ("greedy", "best_q", "majority")
        }
        # The vote over the top answers reads the same search: it costs what the search did.
        cost = {
            k: [_mean(rows, f"{k}_{figure}") for figure in ("tokens", "seconds")]
            for k in ("greedy", "search")
        }
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": n,
                "policy": guided.policy_name,
                "ppm": guided.ppm_path or "none",
                **{f"accuracy_{k}": v for k, v in accuracy.items()},
                "comparison": markdown_table(
                    ["method", "accuracy", "problems", "tokens/problem", "seconds/problem"],
                    [
                        [name, f"{accuracy[k]:.3f}", n, f"{tokens:.0f}", f"{seconds:.2f}"]
                        for name, k, (tokens, seconds) in (
                            ("greedy decoding", "greedy", cost["greedy"]),
                            ("PPM-guided search, best Q", "best_q", cost["search"]),
                            (f"majority of top {p.top_answers}", "majority", cost["search"]),
                        )
                    ],
                ),
                **{f"search_{k}": v for k, v in stats.items()},
            },
        )
