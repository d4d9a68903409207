"""eval_comparison: every trained checkpoint of a round, each way it is evaluated, side by side
on the held-out math problems all the evaluations share, with what each cost.

| checkpoint | methods (from) |
| --- | --- |
| policy (SFT) | greedy (mcts_eval), majority of n samples (sampled here), DSER (dser_eval) |
| policy+ppm | PPM-guided search: best-Q answer, vote over its top answers (mcts_eval) |
| grpo_roc | greedy in one turn, greedy with its Python tool (grpo_eval) |
| attn_gates | the gates' base model, greedy, dense and at each token budget (attn_gate_eval) |
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.dser.chain import ChainState
from rstar_pipelines.dser.evolve import DSERProblem, Judge, extract_answer
from rstar_pipelines.dser.stages import dser_prompts, mean
from rstar_pipelines.dser.vote import vote
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.coroutines import Window
from rstar_pipelines.llm.types import stream
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
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
from rstar_pipelines.problems import verified_problems
from rstar_pipelines.storage import schemas

Key = tuple[str, str]  # (batch, problem id)
Outcome = tuple[bool, int, float]  # correct, tokens, seconds


class ComparisonParams(StageParams):
    round: int = Field(1, ge=1)
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    sampling: SamplingParams = Field(
        SamplingParams(n=8, temperature=0.7),
        description="the majority-vote baseline: n samples of the first-solution prompt",
    )


class EvaluationComparison(Stage):
    """The round's trained checkpoints on the held-out math problems their evaluations share:
    the SFT policy greedy, by a plurality vote over n samples of DSER's first-solution prompt
    (sampled here) and with DSER; the PPM-guided search; the GRPO-RoC policy greedy without and
    with its tool; the attention gates' base model dense and sparse. Each with its accuracy and
    the tokens and seconds it spent per problem."""

    Params = ComparisonParams
    schema = schemas.EVAL_COMPARISON
    prompt_roles = ("solve", "verify", "refine")  # DSER's: its first solutions are sampled
    resources = ("llm",)
    version = "2"  # a row per checkpoint and method

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        models = CheckpointModels(self, ctx, checkpoint_path(inputs, "policy_checkpoint"), None)
        grpo = CheckpointModels(self, ctx, checkpoint_path(inputs, "grpo_roc_checkpoint"), None)
        mcts = _by_problem(_evaluated(inputs, "mcts_eval", models.policy_name))
        dser = _by_problem(
            r for r in _evaluated(inputs, "dser_eval", models.policy_name) if r["domain"] == "math"
        )
        tool_eval = _evaluated(inputs, "grpo_eval", grpo.policy_name)
        grpo_rows = {
            method: _by_problem(
                r for r in tool_eval if r["method"] == method and r["domain"] == "math"
            )
            for method in ("greedy", "tool")
        }
        gates = rows_of(inputs["attn_gate_eval"])
        gate_answers = {g["setting"]: _by_problem(g["answers"]) for g in gates}
        sources = {
            "mcts_eval": mcts,
            "dser_eval": dser,
            **{f"grpo_eval {m}": r for m, r in grpo_rows.items()},
        }
        sources.update({f"attn_gate_eval {s}": a for s, a in gate_answers.items()})
        shared = sorted(set.intersection(*(set(rows) for rows in sources.values())))
        if not shared:
            sizes = ", ".join(f"{name} {len(rows)}" for name, rows in sources.items())
            raise StageInputError(
                f"eval_comparison: the evaluations share no held-out math problem ({sizes} "
                f"problems): evaluate them on the same held-out split with the same max_problems"
            )
        verified = {(q.batch, q.id): q for q in verified_problems(inputs, "math")}
        questions = {key: q.question for key, q in verified.items()}
        missing = [key[1] for key in shared if key not in questions]
        if missing:
            raise StageInputError(
                f"eval_comparison: problems {missing} of the evaluations are not verified math "
                f"problems of verified_outputs any more: re-materialize the evaluations"
            )
        trained_on = [key[1] for key in shared if not p.heldout.is_heldout(verified[key].seed_id)]
        if trained_on:
            raise StageInputError(
                f"eval_comparison: problems {trained_on} are on the training side of the "
                f"held-out split: the evaluations were made with another split; re-materialize them"
            )
        majority = self._majority_of_n(ctx, models, [(k, questions[k], mcts[k]) for k in shared])

        def pick(rows: dict[Key, dict], outcome: Callable[[dict], Outcome]) -> list[Outcome]:
            return [outcome(rows[key]) for key in shared]

        methods: list[tuple[str, str, str, list[Outcome]]] = [
            (
                "policy",
                "greedy",
                models.policy_name,
                pick(
                    mcts, lambda r: (r["greedy_correct"], r["greedy_tokens"], r["greedy_seconds"])
                ),
            ),
            ("policy", f"majority_of_{p.sampling.n}", models.policy_name, majority),
            (
                "policy",
                "dser",
                models.policy_name,
                pick(dser, lambda r: (r["vote_correct"], r["tokens"], r["seconds"])),
            ),
        ]
        with_ppm = any(mcts[key]["ppm"] for key in shared)
        search = lambda column: lambda r: (r[column], r["search_tokens"], r["search_seconds"])  # noqa: E731
        if with_ppm:
            methods += [
                (
                    "policy+ppm",
                    "mcts_best_q",
                    models.policy_name,
                    pick(mcts, search("best_q_correct")),
                ),
                (
                    "policy+ppm",
                    "mcts_majority",
                    models.policy_name,
                    pick(mcts, search("majority_correct")),
                ),
            ]
        else:  # an evaluation search without a PPM: only the vote over all its answers
            methods.append(
                (
                    "policy",
                    "mcts_majority",
                    models.policy_name,
                    pick(mcts, search("majority_correct")),
                )
            )
        for method, rows in grpo_rows.items():
            methods.append(
                (
                    "grpo_roc",
                    method,
                    grpo.policy_name,
                    pick(rows, lambda r: (r["correct"], r["tokens"], r["seconds"])),
                )
            )
        for gate in gates:
            methods.append(
                (
                    "attn_gates",
                    gate["setting"].replace(" ", "_"),
                    f"{gate['base_model']}+gates",
                    pick(
                        gate_answers[gate["setting"]],
                        lambda a: (a["correct"], a["tokens"], a["seconds"]),
                    ),
                )
            )
        rows = [
            {
                "round": p.round,
                "checkpoint": checkpoint,
                "method": name,
                "problems": len(outcomes),
                "accuracy": mean(bool(c) for c, _, _ in outcomes),
                "tokens_per_problem": mean(t for _, t, _ in outcomes),
                "seconds_per_problem": mean(s for _, _, s in outcomes),
                "model": model,
            }
            for checkpoint, name, model, outcomes in methods
        ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(shared),
                "policy": models.policy_name,
                "grpo_roc_policy": grpo.policy_name,
                "comparison": markdown_table(
                    [
                        "checkpoint",
                        "method",
                        "problems",
                        "accuracy",
                        "tokens/problem",
                        "seconds/problem",
                    ],
                    [
                        [
                            r["checkpoint"],
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
                    [
                        (f"{r['checkpoint']} {r['method']}", r["tokens_per_problem"], r["accuracy"])
                        for r in rows
                    ],
                    "accuracy against tokens spent",
                    "tokens per problem",
                    "accuracy",
                ),
            },
        )

    def _majority_of_n(
        self, ctx: StageContext, models: CheckpointModels, shared: list[tuple[Key, str, dict]]
    ) -> list[Outcome]:
        """Per problem: whether the plurality of n samples is right, their tokens, seconds."""
        sampling = self.params.sampling
        solve = dser_prompts(self).solve
        problems = [DSERProblem(key[1], "math", question) for key, question, _ in shared]

        def key(problem: DSERProblem) -> str:
            return fingerprint(models.policy_name, sampling.model_dump(mode="json"), solve(problem))

        def compute(todo: list[DSERProblem], done: Callable[[int, dict], None]) -> None:
            llm = models.policy()
            prompts = [[{"role": "user", "content": solve(q)}] for q in todo]
            window = Window(len(todo))  # every prompt at once: the backend decides the rest
            window.start()
            for j, completions in stream(llm, prompts, sampling):
                item = {
                    "texts": [c.text for c in completions],
                    "tokens": sum(c.completion_tokens for c in completions),
                    "seconds": window.end(j),
                }
                done(j, item)

        stored = ctx.cache.map_streamed(problems, key, compute)
        judge = Judge()
        outcomes = []
        for (_, question, row), sampled in zip(shared, stored, strict=True):
            graded = DSERProblem(row["problem_id"], "math", question, row["gold_answer"])
            answers = [extract_answer("math", text) for text in sampled["texts"]]
            grades = judge.grade([(graded, a) for a in answers])
            states = [
                ChainState(0, text, answer, None, grade.correct, 0)
                for text, answer, grade in zip(sampled["texts"], answers, grades, strict=True)
            ]
            outcomes.append((vote(states, "math").correct, sampled["tokens"], sampled["seconds"]))
        return outcomes


def _by_problem(rows) -> dict[Key, dict]:
    return {(r["batch"], r["problem_id"]): r for r in rows}


def _evaluated(inputs: dict[str, pa.Table], name: str, policy: str) -> list[dict]:
    """An evaluation's rows, all of this round's checkpoint (else they are stale)."""
    rows = rows_of(inputs[name])
    other = sorted({r["policy"] for r in rows} - {policy})
    if other:
        raise StageInputError(
            f"eval_comparison: {name} evaluated {other}, not this round's checkpoint {policy}: "
            f"re-materialize {name}"
        )
    return rows
