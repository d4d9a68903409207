"""eval_comparison: the base policy (round 0) and every trained checkpoint of a round, each way
it is evaluated, side by side on the held-out math problems all the evaluations share, with
intervals, paired tests against round 0 and what each cost.

| round | checkpoint | methods (from) |
| --- | --- | --- |
| 0 | policy (the base) | greedy, search without a PPM (base_policy_eval), majority of n (here) |
| r | policy (SFT) | greedy (mcts_eval), majority of n samples (sampled here), DSER (dser_eval) |
| r | policy+ppm | PPM-guided search: best-Q answer, vote over its top answers (mcts_eval) |
| r | grpo_roc | greedy in one turn, greedy with its Python tool (grpo_eval) |
| r | attn_gates | the gates' base model, greedy, dense and at each token budget (attn_gate_eval) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

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
from rstar_pipelines.pipeline.plots import intervals, labelled_points, markdown_table
from rstar_pipelines.pipeline.stage import (
    Markdown,
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.pipeline.statistics import (
    PairedDifference,
    mcnemar_exact,
    verdict,
    wilson,
)
from rstar_pipelines.pipeline.streamed import Finished, map_problems
from rstar_pipelines.problems import verified_problems
from rstar_pipelines.storage import schemas

Key = tuple[str, str]  # (batch, problem id)


class Outcome(NamedTuple):
    """A method on one problem."""

    correct: bool
    tokens: int
    seconds: float
    completions: int  # full solutions it generated: the candidates its answer was chosen from
    any_correct: bool | None = None  # the oracle: one of them is right (None: one solution)


@dataclass(frozen=True)
class Evaluated:
    """A checkpoint evaluated one way, on every shared problem in order: a row before its
    figures."""

    round: int  # the round that trained it; 0: the base policy
    checkpoint: str
    method: str
    model: str
    outcomes: list[Outcome]


class ComparisonParams(StageParams):
    model: str  # the policy's model role: the base policy, round 0
    round: int = Field(1, ge=1)
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    sampling: SamplingParams = Field(
        SamplingParams(n=8, temperature=0.7),
        description="the majority-vote baseline: n samples of the first-solution prompt",
    )


class EvaluationComparison(Stage):
    """On the held-out math problems their evaluations share: the base policy (round 0:
    greedy, a plurality vote over n samples of DSER's first-solution prompt, the search
    without a PPM); from round 2 on, the checkpoint the round starts from (round r-1's:
    greedy, the vote, its search); and the round's trained checkpoints: the SFT policy greedy,
    by the vote and with DSER; the PPM-guided search; the GRPO-RoC policy greedy without and
    with its tool; the attention gates' base model dense and sparse. Each with its accuracy
    and 95% Wilson interval, its paired difference from round 0 on the same problems with an
    exact McNemar p-value, and what it spent per problem."""

    Params = ComparisonParams
    schema = schemas.EVAL_COMPARISON
    pairs_upstream = True
    prompt_roles = ("solve", "verify", "refine")  # DSER's: its first solutions are sampled
    resources = ("llm",)
    version = "3"  # round 0's rows, intervals and paired tests

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        round_ = self.params.round
        checkpoint = lambda name: CheckpointModels(self, ctx, checkpoint_path(inputs, name), None)  # noqa: E731
        policy, grpo = checkpoint("policy_checkpoint"), checkpoint("grpo_roc_checkpoint")
        # The models round r starts from: the base policy (round 0, the declared model) and,
        # from round 2 on, round r-1's checkpoint as round r-1's mcts_eval evaluated it.
        starts = [(0, CheckpointModels(self, ctx, None, None), "base_policy_eval")]
        if round_ > 1:
            previous = checkpoint("previous_policy_checkpoint")
            starts.append((round_ - 1, previous, "previous_mcts_eval"))
        evaluations = {name: models.policy_name for _, models, name in starts}
        evaluations.update(
            mcts_eval=policy.policy_name, dser_eval=policy.policy_name, grpo_eval=grpo.policy_name
        )
        sources = _sources(inputs, evaluations)
        problems = self._questions(inputs, _shared(sources))
        evaluated = []
        for start_round, models, name in starts:
            evaluated += self._policy(ctx, start_round, models, sources[name], None, problems)
        evaluated += self._policy(
            ctx, round_, policy, sources["mcts_eval"], sources["dser_eval"], problems
        )
        evaluated += _others(inputs, sources, list(problems), round_, grpo.policy_name)
        rows = compare(evaluated)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(problems),
                "base_policy": starts[0][1].policy_name,
                "policy": policy.policy_name,
                "grpo_roc_policy": grpo.policy_name,
                **report(rows),
            },
        )

    def _questions(self, inputs: dict[str, pa.Table], shared: list[Key]) -> dict[Key, str]:
        """The shared problems' questions, in order, once each is proven a held-out verified
        problem."""
        verified = {(q.batch, q.id): q for q in verified_problems(inputs, "math")}
        missing = [key[1] for key in shared if key not in verified]
        if missing:
            raise StageInputError(
                f"eval_comparison: problems {missing} of the evaluations are not verified math "
                f"problems of verified_outputs any more: re-materialize the evaluations"
            )
        split = self.params.heldout
        trained_on = [key[1] for key in shared if not split.is_heldout(verified[key].group)]
        if trained_on:
            raise StageInputError(
                f"eval_comparison: problems {trained_on} are on the training side of the "
                f"held-out split: the evaluations were made with another split; re-materialize them"
            )
        return {key: verified[key].question for key in shared}

    def _policy(
        self,
        ctx: StageContext,
        round_: int,
        models: CheckpointModels,
        searched: dict[Key, dict],
        dser: dict[Key, dict] | None,
        problems: dict[Key, str],
    ) -> list[Evaluated]:
        """A policy's rows: greedy and the search (from its evaluation `searched`), the vote
        over n samples (sampled here), and DSER where it was evaluated."""
        shared = list(problems)
        sampled = self._majority_of_n(
            ctx, models, [(k, q, searched[k]) for k, q in problems.items()]
        )
        row = lambda checkpoint, method, outcomes: Evaluated(  # noqa: E731
            round_, checkpoint, method, models.policy_name, outcomes
        )
        rows = [
            row("policy", "greedy", _outcomes(searched, shared, _greedy)),
            row("policy", f"majority_of_{self.params.sampling.n}", sampled),
        ]
        if dser is not None:
            rows.append(row("policy", "dser", _outcomes(dser, shared, _dser)))
        if any(searched[key]["ppm"] for key in shared):
            rows += [
                row("policy+ppm", f"mcts_{pick}", _outcomes(searched, shared, _search(pick)))
                for pick in ("best_q", "majority")
            ]
        else:  # an evaluation search without a PPM: only the vote over all its answers
            rows.append(
                row("policy", "mcts_majority", _outcomes(searched, shared, _search("majority")))
            )
        return rows

    def _majority_of_n(
        self, ctx: StageContext, models: CheckpointModels, shared: list[tuple[Key, str, dict]]
    ) -> list[Outcome]:
        """Per problem: whether the plurality of n samples is right, and what they cost."""
        sampling = self.params.sampling
        solve = dser_prompts(self).solve
        problems = [DSERProblem(key[1], "math", question) for key, question, _ in shared]

        def key(problem: DSERProblem) -> str:
            return fingerprint(models.policy_name, sampling.model_dump(mode="json"), solve(problem))

        def sample(todo: list[DSERProblem], finished: Finished) -> None:
            llm = models.policy()
            prompts = [[{"role": "user", "content": solve(q)}] for q in todo]
            window = Window(len(todo))  # every prompt at once: the backend decides the rest
            window.start()
            for j, completions in stream(llm, prompts, sampling):
                texts = [c.text for c in completions]
                tokens = sum(c.completion_tokens for c in completions)
                finished(j, {"texts": texts, "tokens": tokens}, window.end(j))

        stored = map_problems(ctx, problems, key, sample, f"sampled {sampling.n} answers to")
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
            outcomes.append(
                Outcome(
                    bool(vote(states, "math").correct),
                    sampled["tokens"],
                    sampled["seconds"],
                    len(states),
                    any(grade.correct for grade in grades),
                )
            )
        return outcomes


def _by_problem(rows) -> dict[Key, dict]:
    return {(r["batch"], r["problem_id"]): r for r in rows}


def _evaluated(inputs: dict[str, pa.Table], name: str, policy: str) -> list[dict]:
    """An evaluation's rows, all of the checkpoint it should have evaluated (else stale)."""
    rows = rows_of(inputs[name])
    other = sorted({r["policy"] for r in rows} - {policy})
    if other:
        raise StageInputError(
            f"eval_comparison: {name} evaluated {other}, not {policy}, the checkpoint it "
            f"should have: re-materialize {name}"
        )
    return rows


def _sources(inputs: dict[str, pa.Table], policies: dict[str, str]) -> dict[str, dict[Key, dict]]:
    """Every evaluation's math rows by problem, named by where they come from; each
    evaluation of the model `policies` names for it."""
    sources = {}
    for name, policy in policies.items():
        rows = [r for r in _evaluated(inputs, name, policy) if r.get("domain", "math") == "math"]
        if name == "grpo_eval":
            for method in ("greedy", "tool"):
                sources[f"grpo_eval {method}"] = _by_problem(
                    r for r in rows if r["method"] == method
                )
        else:
            sources[name] = _by_problem(rows)
    for gate in rows_of(inputs["attn_gate_eval"]):
        sources[f"attn_gate_eval {gate['setting']}"] = _by_problem(gate["answers"])
    return sources


def _shared(sources: dict[str, dict[Key, dict]]) -> list[Key]:
    """The problems every evaluation answered: every row is paired over them."""
    shared = sorted(set.intersection(*(set(rows) for rows in sources.values())))
    if not shared:
        sizes = ", ".join(f"{name} {len(rows)}" for name, rows in sources.items())
        raise StageInputError(
            f"eval_comparison: the evaluations share no held-out math problem ({sizes} "
            f"problems): evaluate them on the same held-out split with the same max_problems"
        )
    return shared


def _outcomes(
    rows: dict[Key, dict], shared: list[Key], outcome: Callable[[dict], Outcome]
) -> list[Outcome]:
    return [outcome(rows[key]) for key in shared]


def _greedy(r: dict) -> Outcome:
    return Outcome(r["greedy_correct"], r["greedy_tokens"], r["greedy_seconds"], 1)


def _search(pick: str) -> Callable[[dict], Outcome]:
    """The search's answer by `pick` (best_q or majority), among every answer it found."""
    return lambda r: Outcome(
        bool(r[f"{pick}_correct"]),
        r["search_tokens"],
        r["search_seconds"],
        r["search_answers"],
        r["search_any_correct"],
    )


def _dser(r: dict) -> Outcome:
    states = r["states"]
    return Outcome(
        r["vote_correct"], r["tokens"], r["seconds"], len(states), any(s["correct"] for s in states)
    )


def _single(r: dict) -> Outcome:
    return Outcome(r["correct"], r["tokens"], r["seconds"], 1)


def _others(
    inputs: dict[str, pa.Table],
    sources: dict[str, dict[Key, dict]],
    shared: list[Key],
    round_: int,
    grpo: str,
) -> list[Evaluated]:
    """The GRPO-RoC policy greedy without and with its tool; the gates' base model dense and
    at each token budget."""
    rows = [
        Evaluated(
            round_, "grpo_roc", m, grpo, _outcomes(sources[f"grpo_eval {m}"], shared, _single)
        )
        for m in ("greedy", "tool")
    ]
    for gate in rows_of(inputs["attn_gate_eval"]):
        answers = sources[f"attn_gate_eval {gate['setting']}"]
        rows.append(
            Evaluated(
                round_,
                "attn_gates",
                gate["setting"].replace(" ", "_"),
                f"{gate['base_model']}+gates",
                _outcomes(answers, shared, _single),
            )
        )
    return rows


def _baseline(row: Evaluated, round_zero: dict[str, Evaluated]) -> Evaluated | None:
    """The round-0 row of the same method, else round 0's greedy decoding; none for itself."""
    for method in (row.method, "greedy"):
        found = round_zero.get(method)
        if found is not None and found is not row:
            return found
    return None


def compare(evaluated: list[Evaluated]) -> list[dict]:
    """The table's rows: each with its 95% Wilson interval and, against its round-0 baseline
    on the same problems, the paired difference and the exact McNemar p-value."""
    round_zero = {e.method: e for e in evaluated if e.round == 0}
    rows = []
    for e in evaluated:
        correct = [bool(o.correct) for o in e.outcomes]
        accuracy = wilson(sum(correct), len(correct))
        baseline = _baseline(e, round_zero)
        paired = (
            mcnemar_exact([bool(o.correct) for o in baseline.outcomes], correct)
            if baseline
            else None
        )
        oracle = [o.any_correct for o in e.outcomes]
        rows.append(
            {
                "round": e.round,
                "checkpoint": e.checkpoint,
                "method": e.method,
                "problems": len(correct),
                "correct": accuracy.correct,
                "accuracy": accuracy.value,
                "accuracy_low": accuracy.low,
                "accuracy_high": accuracy.high,
                "baseline": f"round 0 {baseline.method}" if baseline else None,
                **(asdict(paired) if paired else {}),
                "completions_per_problem": mean(o.completions for o in e.outcomes),
                "tokens_per_problem": mean(o.tokens for o in e.outcomes),
                "seconds_per_problem": mean(o.seconds for o in e.outcomes),
                "oracle_any_correct": None if None in oracle else mean(oracle),
                "model": e.model,
            }
        )
    return rows


METHOD_COLUMNS = [
    "round",
    "checkpoint",
    "method",
    "correct",
    "accuracy [95% CI]",
    "against",
    "difference",
    "p (exact McNemar)",
    "completions/problem",
    "tokens/problem",
    "seconds/problem",
]


def _method_cells(r: dict) -> list[object]:
    against = ["", "", ""]
    if r["baseline"] is not None:
        against = [r["baseline"], f"{r['difference']:+.3f}", f"{r['p_value']:.3g}"]
    return [
        r["round"],
        r["checkpoint"],
        r["method"],
        f"{r['correct']}/{r['problems']}",
        f"{r['accuracy']:.3f} [{r['accuracy_low']:.3f}, {r['accuracy_high']:.3f}]",
        *against,
        f"{r['completions_per_problem']:.1f}",
        f"{r['tokens_per_problem']:.0f}",
        f"{r['seconds_per_problem']:.2f}",
    ]


def _oracle(rows: list[dict]) -> Markdown:
    table = markdown_table(
        ["round", "checkpoint", "method", "solutions/problem", "any solution correct"],
        [
            [
                r["round"],
                r["checkpoint"],
                r["method"],
                f"{r['completions_per_problem']:.1f}",
                f"{a:.3f}",
            ]
            for r in rows
            if (a := r["oracle_any_correct"]) is not None
        ],
    )
    return Markdown(
        "An oracle, not a method: it reads the gold answer to say whether any solution a method "
        f"generated is right (what a perfect picker would score).\n\n{table}"
    )


def _verdict(rows: list[dict]) -> str:
    compared = [
        (
            f"round {r['round']} {r['checkpoint']} {r['method']} against {r['baseline']}",
            PairedDifference(r["difference"], r["gained"], r["lost"], r["p_value"]),
        )
        for r in rows
        if r["baseline"] is not None
    ]
    return verdict(compared, rows[0]["problems"])


def report(rows: list[dict]) -> dict[str, object]:
    """The rows as a reader sees them: the methods' table, the oracle's apart, the verdict
    on significance in words, and the accuracies with their intervals by round and method."""
    name = lambda r: f"{r['checkpoint']} {r['method']}"  # noqa: E731
    return {
        "comparison": markdown_table(METHOD_COLUMNS, [_method_cells(r) for r in rows]),
        "significance": _verdict(rows),
        "oracle": _oracle(rows),
        "accuracy_by_round": intervals(
            [
                (
                    f"round {r['round']}",
                    name(r),
                    r["accuracy"],
                    r["accuracy_low"],
                    r["accuracy_high"],
                )
                for r in rows
            ],
            "accuracy (95% Wilson interval) by round and method",
            "accuracy",
        ),
        "accuracy_vs_tokens": labelled_points(
            [(f"{r['round']}: {name(r)}", r["tokens_per_problem"], r["accuracy"]) for r in rows],
            "accuracy against tokens spent",
            "tokens per problem",
            "accuracy",
        ),
    }
