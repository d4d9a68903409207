"""mcts_eval: greedy decoding and the PPM-guided search in evaluation mode, on the held-out
problems. Neither search is given a gold answer: the answer steps of the guided search are
valued by the PPM (the reference's evaluation mode), and the gold answer scores each method's
final pick afterwards."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.math.answers import equivalent
from rstar_pipelines.math.evaluation import (
    all_answers_vote,
    best_q_answer,
    greedy_config,
    top_answers_vote,
)
from rstar_pipelines.math.search_stages import (
    SearchStage,
    SearchStageParams,
    search_trees_side_by_side,
)
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import Markdown, StageContext, StageResult
from rstar_pipelines.problems import evaluated_row, heldout_problems
from rstar_pipelines.storage import schemas

NO_PPM = (
    "no PPM: in evaluation mode only a PPM values the answers a search finds (the gold answer "
    "is never read), so there is no best-Q answer; the vote is over every answer the search found"
)


class EvalParams(SearchStageParams):
    round: int = Field(1, ge=0, description="the round that trained the policy; 0: the base")
    prompt: Literal["bootstrap", "policy"] = "policy"
    top_answers: int = Field(4, ge=1, description="highest-Q answers the vote is over")


def _correct(answer: str | None, gold: str) -> bool | None:
    """Scored after the search; None where the method gave no pick (best-Q without a PPM)."""
    return answer is not None and equivalent(answer, gold)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class MCTSEvaluation(SearchStage):
    """On the held-out split of verified math problems, this round's policy: greedy decoding,
    and the PPM-guided search answered by its best-Q leaf and by a majority vote over its top
    answers. The search never sees the gold answer; without a PPM it reports the vote over all
    its answers and says why best-Q is absent."""

    Params = EvalParams
    schema = schemas.MCTS_EVAL
    version = "3"  # best-Q ties as the reference breaks them; early-walk trees as the reference's

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        problems = heldout_problems(inputs, p.heldout, p.max_problems, "mcts_eval", "math")
        policy = checkpoint_path(inputs, "policy_checkpoint")
        guided = CheckpointModels(self, ctx, policy, checkpoint_path(inputs, "ppm_checkpoint"))
        plain = CheckpointModels(self, ctx, policy, None)
        # The search's trees first: the greedy chains, shorter, fill the room its last leave.
        searched, greedy = search_trees_side_by_side(
            self, ctx, problems, [(guided, p.search), (plain, greedy_config(p.search))], gold=False
        )
        rows = [
            {
                **evaluated_row(problem, p.round),
                **self._answers(problem, greedy.trees[i], searched.trees[i], guided),
                "greedy_seconds": greedy.seconds[i],
                "search_seconds": searched.seconds[i],
                "policy": guided.policy_name,
                "ppm": guided.ppm_path,
            }
            for i, problem in enumerate(problems)
        ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(rows),
                "policy": guided.policy_name,
                "ppm": guided.ppm_path or NO_PPM,
                "gold_answer_in_search": False,
                "answers_valued_by_ppm": sum(r["answers_valued_by_ppm"] for r in rows),
                **self._summary(rows, with_ppm=guided.ppm_path is not None),
                **{f"search_{k}": v for k, v in searched.stats.items()},
            },
        )

    def _answers(self, problem, greedy, searched, guided: CheckpointModels) -> dict:
        """One problem's picks, each scored against the gold answer, and what each tree cost."""
        with_ppm = guided.ppm_path is not None
        answers = {
            "greedy": best_q_answer(greedy),  # its only answer: one sample, one path
            "best_q": best_q_answer(searched) if with_ppm else None,
            "majority": (
                top_answers_vote(searched, self.params.top_answers)
                if with_ppm
                else all_answers_vote(searched)
            ),
        }
        found = [n.final_answer for n in searched.answers() if n.final_answer]
        return {
            **{f"{k}_answer": v for k, v in answers.items()},
            "greedy_correct": _correct(answers["greedy"], problem.answer),
            "best_q_correct": _correct(answers["best_q"], problem.answer) if with_ppm else None,
            "majority_correct": _correct(answers["majority"], problem.answer),
            "search_any_correct": any(equivalent(a, problem.answer) for a in found),
            "search_answers": len(found),
            "answers_valued_by_ppm": sum(1 for n in searched.answers() if n.value is not None),
            "search_nodes": searched.nodes.num_rows,
            "greedy_tokens": greedy.completion_tokens,
            "search_tokens": searched.completion_tokens,
        }

    def _summary(self, rows: list[dict], with_ppm: bool) -> dict:
        """Each method's accuracy and cost over the problems, and the search's oracle apart."""
        accuracy = {
            k: _mean([r[f"{k}_correct"] for r in rows]) for k in ("greedy", "best_q", "majority")
        }
        any_correct = _mean([r["search_any_correct"] for r in rows])
        cost = {
            k: [_mean([r[f"{k}_{figure}"] for r in rows]) for figure in ("tokens", "seconds")]
            for k in ("greedy", "search")
        }
        vote = (
            f"majority of top {self.params.top_answers}" if with_ppm else "majority of all answers"
        )
        methods = [("greedy decoding", "greedy", cost["greedy"])]
        if with_ppm:
            methods.append(("PPM-guided search, best Q", "best_q", cost["search"]))
        methods.append((f"search, {vote}", "majority", cost["search"]))
        return {
            **{f"accuracy_{k}": v for k, v in accuracy.items() if v is not None},
            "oracle_search_any_correct": Markdown(
                f"{any_correct:.3f}: the share of problems where any answer the search "
                f"found is right. An oracle, not a method: it reads the gold answer."
            ),
            "comparison": markdown_table(
                ["method", "accuracy", "problems", "tokens/problem", "seconds/problem"],
                [
                    [name, f"{accuracy[k]:.3f}", len(rows), f"{tok:.0f}", f"{sec:.2f}"]
                    for name, k, (tok, sec) in methods
                ],
            ),
        }
