"""dser_eval: deep self-evolving reasoning with the round's policy on the held-out problems
(math and code), with the Markov diagnostics of its chains."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.dser.evolve import (
    DSERConfig,
    DSERProblem,
    DSERPrompts,
    DSERRun,
    Judge,
    run_dser,
)
from rstar_pipelines.dser.markov import (
    TransitionCounts,
    accuracy_by_iteration,
    estimate,
    observed_accuracy,
    transition_counts,
)
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.llm.coroutines import OPEN_MEMORY_MB
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import line_plot, markdown_table
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageParams, StageResult
from rstar_pipelines.pipeline.streamed import Finished, map_problems
from rstar_pipelines.problems import VerifiedProblem, evaluated_row, heldout_problems
from rstar_pipelines.storage import schemas


def dser_problem(problem: VerifiedProblem) -> DSERProblem:
    return DSERProblem(
        problem.id, problem.domain, problem.question, problem.answer, problem.inputs, problem.labels
    )


def dser_prompts(stage: Stage) -> DSERPrompts:
    return DSERPrompts.from_templates(
        stage.prompts["solve"], stage.prompts["verify"], stage.prompts["refine"]
    )


class DSEREvalParams(StageParams):
    round: int = Field(1, ge=1)
    dser: DSERConfig = DSERConfig()
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    max_problems: int | None = Field(None, ge=1, description="at most this many of each domain")
    timeout_s: float = Field(5.0, gt=0, description="per program run, grading code states")
    memory_mb: int = Field(256, gt=0)
    open_chains_memory_mb: float = Field(
        OPEN_MEMORY_MB,
        gt=0,
        description="MiB the open problems' chains may hold: problems start as the fleet has "
        "room, at most as many at once as this holds (dser.evolve.problem_bytes)",
    )


class DSEREvaluation(Stage):
    """On the held-out verified problems (math and code), this round's policy evolving
    its own solutions: parallel verify-then-refine chains, a vote over their last states,
    and the two-state Markov chain the transitions between states estimate."""

    Params = DSEREvalParams
    schema = schemas.DSER_EVAL
    prompt_roles = ("solve", "verify", "refine")
    resources = ("llm", "sandbox")
    kinds = frozenset({"python", "docker"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        problems = heldout_problems(inputs, p.heldout, p.max_problems, "dser_eval")
        models = CheckpointModels(self, ctx, checkpoint_path(inputs, "policy_checkpoint"), None)
        outcomes = self._evolve(ctx, models, problems)
        rows = [
            {**evaluated_row(q, p.round), **outcome, "policy": models.policy_name}
            for q, outcome in zip(problems, outcomes, strict=True)
        ]
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={"policy": models.policy_name, **_dser_summary(rows, p.dser.vote_last)},
        )

    def _evolve(
        self, ctx: StageContext, models: CheckpointModels, problems: list[VerifiedProblem]
    ) -> list[dict]:
        """Each problem's outcome of its chains, the vote over them and their Markov figures."""
        p = self.params
        prompts = dser_prompts(self)

        def key(q: VerifiedProblem) -> str:
            return fingerprint(
                models.policy_name,
                p.dser.model_dump(mode="json"),
                p.timeout_s,
                p.memory_mb,
                {role: t.sha256 for role, t in sorted(self.prompts.items())},
                [q.domain, q.question, q.answer, q.inputs, q.labels],
            )

        def run(todo: list[VerifiedProblem], finished: Finished) -> None:
            llm = models.policy()  # loaded before the evolution: the seconds are its own
            code = any(q.domain == "code" for q in todo)
            judge = Judge(ctx.resource("sandbox").get() if code else None, p.timeout_s, p.memory_mb)

            def evolved(j: int, run: DSERRun, seconds: float) -> None:
                finished(j, _outcome(run, p.dser.vote_last), seconds)

            dser_problems = [dser_problem(q) for q in todo]
            run_dser(llm, dser_problems, p.dser, prompts, judge, evolved, p.open_chains_memory_mb)

        return map_problems(ctx, problems, key, run, "evolved")


def _outcome(run: DSERRun, vote_last: int) -> dict:
    """What is kept of one problem's run: plain values, as cached and as the row holds them."""
    graded = run.correctness
    counts = transition_counts(graded)
    markov = estimate(counts)
    return {
        "vote_answer": run.vote_answer,
        "vote_correct": run.vote_correct,
        "states": [
            {
                "chain": c,
                "iteration": s.iteration,
                "text": s.text,
                "answer": s.answer,
                "verdict": s.verdict,
                "correct": s.correct,
                "tokens": s.tokens,
            }
            for c, chain in enumerate(run.chains)
            for s in chain
        ],
        **{f"transitions_{k}": getattr(counts, k) for k in ("cc", "ci", "ic", "ii")},
        "p_improve": markov.p_improve,
        "p_degrade": markov.p_degrade,
        "predicted_accuracy": markov.predicted,
        "observed_accuracy": observed_accuracy(graded, vote_last),
        "tokens": run.tokens,
        "calls": run.calls,
    }


def _chains(row: dict) -> list[list[bool]]:
    """A row's per-chain correctness, in iteration order."""
    chains: dict[int, list[bool]] = defaultdict(list)
    for state in sorted(row["states"], key=lambda s: (s["chain"], s["iteration"])):
        chains[state["chain"]].append(state["correct"])
    return list(chains.values())


def _dser_summary(rows: list[dict], vote_last: int) -> dict:
    """Per domain: the vote's accuracy, the first solutions', and the Markov diagnostics
    of all its chains pooled; and the accuracy of the states per iteration."""
    table, by_iteration = [], {}
    for domain in ("math", "code"):
        mine = [r for r in rows if r["domain"] == domain]
        if mine:
            chains = [chain for r in mine for chain in _chains(r)]
            by_iteration[domain] = accuracy_by_iteration(chains)
            first = by_iteration[domain][0]
            table.append([domain, len(mine), *_domain_figures(mine, chains, first, vote_last)])
    return {
        "problems": len(rows),
        "accuracy": mean(r["vote_correct"] for r in rows),
        "tokens_per_problem": mean(r["tokens"] for r in rows),
        "seconds_per_problem": mean(r["seconds"] for r in rows),
        "summary": markdown_table(
            [
                "domain",
                "problems",
                "vote accuracy",
                "first solutions",
                f"last {vote_last} states",
                "Markov prediction",
                "p_improve",
                "p_degrade",
                "tokens/problem",
                "seconds/problem",
            ],
            table,
        ),
        **{
            f"accuracy_by_iteration_{domain}": line_plot(
                values,
                f"DSER {domain}: correct states by iteration",
                "iteration (0: first solution)",
                "fraction correct",
                first_x=0,
            )
            for domain, values in by_iteration.items()
        },
    }


def _domain_figures(
    rows: list[dict], chains: list[list[bool]], first: float, vote_last: int
) -> list[str]:
    """One domain's summary cells, from its rows, their chains' correctness and the accuracy
    of the first solutions: from the vote's accuracy to the seconds per problem."""
    counts = sum(
        (
            TransitionCounts(*(r[f"transitions_{k}"] for k in ("cc", "ci", "ic", "ii")))
            for r in rows
        ),
        TransitionCounts(),
    )
    markov = estimate(counts)
    return [
        _fmt(mean(r["vote_correct"] for r in rows)),
        _fmt(first),
        _fmt(observed_accuracy(chains, vote_last)),
        _fmt(markov.predicted),
        _fmt(markov.p_improve),
        _fmt(markov.p_degrade),
        f"{mean(r['tokens'] for r in rows):.0f}",
        f"{mean(r['seconds'] for r in rows):.2f}",
    ]


def mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
