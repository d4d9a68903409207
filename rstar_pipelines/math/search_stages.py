"""Stage kinds of the rStar-Math search: mcts_trajectories (with the node table of every
tree), ppm_pairs and sft_dataset."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from statistics import fmean
from typing import ClassVar, Literal

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.llm.coroutines import OPEN_MEMORY_MB
from rstar_pipelines.llm.types import serves_each_request
from rstar_pipelines.math.mcts import (
    MCTSConfig,
    MCTSSearch,
    Problem,
    StepPrompt,
    Tree,
)
from rstar_pipelines.math.pairs import best_trajectories, preference_pairs, trajectories
from rstar_pipelines.math.steps import assistant_text
from rstar_pipelines.math.tree import tree_from_rows
from rstar_pipelines.pipeline.generation import CheckpointModels, checkpoint_path
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import histogram
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.pipeline.streamed import Finished, map_problems
from rstar_pipelines.problems import (
    NO_HELDOUT_CHECK,
    VerifiedProblem,
    batch_groups,
    groups_of,
    no_heldout_check,
    on_side,
    seeds_of,
    verified_problems,
)
from rstar_pipelines.storage import schemas


def search_problems(
    inputs: dict[str, pa.Table], params, groups: dict[str, str] | None = None
) -> list[VerifiedProblem]:
    """The verified math problems the search trains on: those outside the held-out split, at
    most max_problems (by `groups`, default every batch's problem_groups)."""
    found = on_side(verified_problems(inputs, "math", groups), params.heldout, heldout=False)
    return found[: params.max_problems]


class SearchStageParams(StageParams):
    model: str  # the policy's model role (round 1; later rounds search with the last policy)
    round: int = Field(1, ge=1)
    prompt: Literal["bootstrap", "policy"] = Field(
        "bootstrap",
        description="bootstrap: the few-shot prompt continued as raw text; policy: the chat "
        "format a trained policy learned (rounds >= 2)",
    )
    search: MCTSConfig = MCTSConfig()
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    max_problems: int | None = Field(None, ge=1, description="search at most this many")
    window: int | None = Field(
        None,
        ge=1,
        description="at most this many trees open at once, where declared; by default the "
        "fleet decides: another tree opens whenever its windows have room (every tree at once "
        "over an in-process model), within open_trees_memory_mb. Each tree is committed to "
        "the item cache when it ends",
    )
    open_trees_memory_mb: float = Field(
        OPEN_MEMORY_MB,
        gt=0,
        description="memory the open trees may hold: at most this over the most one tree of "
        "`search` can hold trees are open (mcts.open_trees_bound)",
    )


def step_prompt(stage: Stage, kind: str) -> StepPrompt:
    template = stage.prompts[kind]
    return StepPrompt(lambda q: template.render(question=q), chat=kind == "policy")


@dataclass
class SearchRun:
    """What search_trees found: one tree per problem, the wall seconds of each (its share of
    the search's wall time, each moment split evenly among the trees open then; kept with the
    tree so that a cache hit keeps it), and the figures of the searches run now (none when
    every tree came from the cache)."""

    trees: list[Tree]
    seconds: list[float]
    stats: dict


def search_trees(
    stage: Stage,
    ctx: StageContext,
    problems: list[VerifiedProblem],
    models: CheckpointModels,
    config: MCTSConfig,
    gold: bool,
    after: threading.Event | None = None,
    all_opened: threading.Event | None = None,
) -> SearchRun:
    """Search one tree per problem (cached per problem). With `gold`, answer steps are scored
    against each problem's verified answer (data generation); without, the search never sees
    it (evaluation: answer steps are valued by the PPM, and scored only afterwards). The
    search opens its first tree once `after` is set; `all_opened` is set once it has opened
    its last (or has none to open)."""
    params = stage.params
    prompt = step_prompt(stage, params.prompt)
    searcher: list[MCTSSearch] = []

    def problem(p: VerifiedProblem) -> Problem:
        return Problem(p.id, p.question, p.answer if gold else None)

    def key(p: VerifiedProblem) -> str:
        return fingerprint(
            models.policy_name,
            models.ppm_path,
            config.model_dump(mode="json"),
            stage.prompts[params.prompt].sha256,
            p.question,
            p.answer if gold else None,
        )

    def run(todo: list[VerifiedProblem], finished: Finished) -> None:
        search = MCTSSearch(
            models.policy(), ctx.resource("sandbox").get(), config, models.ppm(), prompt
        )
        searcher.append(search)  # after loading the models: the seconds are the search's own

        def searched(j: int, tree: Tree, seconds: float) -> None:
            finished(j, {"nodes": tree.nodes.to_pylist()}, seconds)

        if after is not None:
            after.wait()
        todo_problems = [problem(p) for p in todo]
        memory_mb = params.open_trees_memory_mb
        search.run(todo_problems, params.window, searched, memory_mb, all_opened)
        ctx.log.info(f"search figures: {search.stats.as_dict()}")

    try:
        stored = map_problems(ctx, problems, key, run, "searched the trees of")
    finally:
        if all_opened is not None:
            all_opened.set()  # whatever the cache held, and on an error: nobody waits forever
    return SearchRun(
        trees=[
            Tree(problem(p), tree_from_rows(item["nodes"]))
            for p, item in zip(problems, stored, strict=True)
        ],
        seconds=[item["seconds"] for item in stored],
        stats=searcher[0].stats.as_dict() if searcher else {},
    )


def search_trees_side_by_side(
    stage: Stage,
    ctx: StageContext,
    problems: list[VerifiedProblem],
    searches: list[tuple[CheckpointModels, MCTSConfig]],
    gold: bool,
) -> list[SearchRun]:
    """`search_trees` for each (models, config) of `searches` over the same problems. Over a
    fleet they run at once, a thread each: one search's last long trees would otherwise leave
    the fleet idle while the next waits to start. Each opens its first tree once the one
    before it has opened its last, so that the fleet's room goes to the first while it has
    trees to open and the later ones fill what its last trees leave as they end: list the
    search of the longest trees first. Over an in-process model one after another: its
    batcher runs together only prompts of equal sampling, so nothing would be shared."""
    if not all(serves_each_request(models.policy()) for models, _ in searches):
        return [search_trees(stage, ctx, problems, m, c, gold) for m, c in searches]
    opened = [threading.Event() for _ in searches]
    waits_for = [None, *opened[:-1]]
    with ThreadPoolExecutor(len(searches)) as pool:
        running = [
            pool.submit(search_trees, stage, ctx, problems, m, c, gold, after, all_opened)
            for (m, c), after, all_opened in zip(searches, waits_for, opened, strict=True)
        ]
        return [future.result() for future in running]


class SearchStage(Stage):
    """A stage that searches: it renders either prompt and needs a policy and a sandbox."""

    prompt_roles = ("bootstrap", "policy")
    resources = ("llm", "sandbox")
    kinds = frozenset({"python", "docker"})


class MCTSTrajectories(SearchStage):
    """MCTS over code-augmented CoT on the batch's verified math problems of the training side
    of the held-out split: the completed trajectories with per-step Q-values, and the node
    table of every tree (`mcts_nodes`)."""

    Params = SearchStageParams
    schema = schemas.MCTS_TRAJECTORIES
    secondary_outputs: ClassVar[dict[str, pa.Schema]] = {"nodes": schemas.MCTS_NODES}
    version = "3"  # early-walk trees the reference's whatever order the samples arrive in

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        # The batch's own groups: a tree whose group among every batch is held out is left out
        # of the training tables (training_trees), so none is trained on.
        groups = batch_groups(inputs["synthesized_problems"], p.heldout)
        problems = search_problems(inputs, p, groups)
        models = CheckpointModels(
            self,
            ctx,
            checkpoint_path(inputs, "previous_policy_checkpoint"),
            checkpoint_path(inputs, "previous_ppm_checkpoint"),
        )
        searched = search_trees(self, ctx, problems, models, p.search, gold=True)
        nodes, found = [], []
        for problem, tree in zip(problems, searched.trees, strict=True):
            base = {
                "problem_id": problem.id,
                "seed_id": problem.seed_id,
                "batch": problem.batch,
                "round": p.round,
            }
            extra = {
                "question": problem.question,
                "gold_answer": problem.answer,
                "model": models.policy_name,
            }
            nodes += [{**base, **extra, **row} for row in tree.nodes.to_pylist()]
            for t in trajectories(tree):
                found.append(
                    {
                        "id": fingerprint(problem.id, p.round, t.leaf.node_id)[:16],
                        **base,
                        "leaf_id": t.leaf.node_id,
                        "steps": t.steps,
                        "q_values": t.q_values,
                        "final_answer": t.leaf.final_answer,
                        "correct": t.correct,
                        "mean_q": fmean(t.q_values),
                        "min_q": min(t.q_values),
                        "model": models.policy_name,
                    }
                )
        kinds = Counter(n["kind"] for n in nodes if n["terminal"])
        answers = [n for n in nodes if n["kind"] == "answer"]
        return StageResult(
            table=pa.Table.from_pylist(found, schema=self.schema),
            secondary={"nodes": pa.Table.from_pylist(nodes, schema=schemas.MCTS_NODES)},
            metadata={
                "round": p.round,
                "policy": models.policy_name,
                "ppm": models.ppm_path or "none",
                "trees": len(searched.trees),
                "nodes": len(nodes),
                "trees_with_a_correct_answer": len(
                    {n["problem_id"] for n in answers if n["correct"]}
                ),
                "correct_terminals": sum(1 for n in answers if n["correct"]),
                "wrong_terminals": sum(1 for n in answers if not n["correct"]),
                "terminals_by_kind": dict(kinds),
                **{f"search_{k}": v for k, v in searched.stats.items()},
            },
        )


@dataclass(frozen=True)
class StoredTree:
    tree: Tree
    batch: str
    seed_id: str


def stored_trees(nodes: pa.Table) -> list[StoredTree]:
    """The trees of a node table, one per (batch, problem)."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in nodes.to_pylist():
        grouped[(row["batch"], row["problem_id"])].append(row)
    trees = []
    for (batch, problem_id), rows in sorted(grouped.items()):
        problem = Problem(problem_id, rows[0]["question"], rows[0]["gold_answer"])
        root = tree_from_rows([{k: r.get(k) for k in schemas.NODE.names} for r in rows])
        trees.append(StoredTree(Tree(problem, root), batch, rows[0]["seed_id"]))
    return trees


class TrainingTableParams(StageParams):
    round: int = Field(1, ge=1)
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader


def training_trees(
    inputs: dict[str, pa.Table], split: HeldoutSplit
) -> tuple[list[StoredTree], dict[str, str], int]:
    """The searched trees of the training side, the near-duplicate groups of problem_groups
    (problem -> group), and how many trees were left out as held-out (none, when the search
    kept to its side)."""
    groups = groups_of(inputs["problem_groups"])
    trees = stored_trees(inputs["mcts_nodes"])
    kept = [t for t in trees if not split.is_heldout(groups.get(t.tree.problem.id, t.seed_id))]
    return kept, groups, len(trees) - len(kept)


class PairParams(TrainingTableParams):
    min_margin: float = Field(0.5, ge=0, description="least Q difference of a kept pair")
    min_edit_distance: int = Field(20, ge=0, description="least Levenshtein distance, in chars")
    final_pairs: bool = Field(
        True,
        description="also pair whole trajectories (the paper); the released code makes step "
        "pairs only",
    )


class PreferencePairs(Stage):
    """Step-level (and final-answer) preference pairs from every searched tree of the training
    side of the split, in TRL's reward layout: prompt, chosen, rejected, margin."""

    Params = PairParams
    schema = schemas.PPM_PAIRS
    checks = (NO_HELDOUT_CHECK,)
    version = "2"  # seed_id, the split's check, final pairs as an option

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        trees, groups, left_out = training_trees(inputs, p.heldout)
        rows = []
        for stored in trees:
            tree = stored.tree
            for pair in preference_pairs(
                tree, p.min_margin, p.min_edit_distance, final_pairs=p.final_pairs
            ):
                rows.append(
                    {
                        "id": fingerprint(tree.problem.id, p.round, pair.chosen, pair.rejected)[
                            :16
                        ],
                        "problem_id": tree.problem.id,
                        "seed_id": stored.seed_id,
                        "batch": stored.batch,
                        "round": p.round,
                        **{k: getattr(pair, k) for k in schemas.PPM_PAIRS.names[5:]},
                    }
                )
        kinds = Counter(r["kind"] for r in rows)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "trees": len(trees),
                "heldout_trees_left_out": left_out,
                "trees_with_pairs": len({r["problem_id"] for r in rows}),
                "step_pairs": kinds["step"],
                "final_pairs": kinds["final"],
                "margin_distribution": histogram(
                    [r["margin"] for r in rows],
                    "pair margins",
                    "Q margin",
                    "pairs",
                    value_range=(0, 2),
                ),
            },
            checks=[no_heldout_check(rows, groups, p.heldout)],
        )


class SFTParams(TrainingTableParams):
    per_problem: int = Field(2, ge=1, description="best correct trajectories kept per problem")


class SFTDataset(Stage):
    """Policy fine-tuning data as chat messages, from the training side of the split only: the
    best correct trajectories of each tree by mean then minimum Q (docs/rstar-math.md), plus the
    verified solutions of the training side's problems."""

    Params = SFTParams
    schema = schemas.SFT_DATASET
    prompt_roles = ("policy",)
    checks = (NO_HELDOUT_CHECK,)
    version = "2"  # held-out problems' verified solutions left out, seed_id, the split's check

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        user = self.prompts["policy"]
        trees, groups, left_out = training_trees(inputs, p.heldout)
        rows = []
        for stored in trees:
            tree = stored.tree
            for t in best_trajectories(tree, p.per_problem):
                messages = [
                    {"role": "user", "content": user.render(question=tree.problem.question)},
                    {"role": "assistant", "content": assistant_text(t.steps)},
                ]
                rows.append(
                    {
                        "id": fingerprint(tree.problem.id, p.round, t.leaf.node_id)[:16],
                        "source": "mcts",
                        "problem_id": tree.problem.id,
                        "seed_id": stored.seed_id,
                        "batch": stored.batch,
                        "round": p.round,
                        "domain": "math",
                        "messages": messages,
                        "mean_q": fmean(t.q_values),
                        "min_q": min(t.q_values),
                    }
                )
        from_trees = len(rows)
        solutions = rows_of(inputs["verified_solutions"])
        lineage = seeds_of(inputs["synthesized_problems"])
        kept = [
            r
            for r in solutions
            if r["problem_id"] in groups and not p.heldout.is_heldout(groups[r["problem_id"]])
        ]
        for r in kept:
            rows.append(
                {
                    "id": r["id"],
                    "source": "verified_solutions",
                    "problem_id": r["problem_id"],
                    "seed_id": lineage.get(r["problem_id"]),
                    "batch": r["batch"],
                    "round": p.round,
                    "domain": r["domain"],
                    "messages": r["messages"],
                    "mean_q": None,
                    "min_q": None,
                }
            )
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "from_trees": from_trees,
                "from_verified_solutions": len(rows) - from_trees,
                "heldout_trees_left_out": left_out,
                "heldout_solutions_left_out": len(solutions) - len(kept),
            },
            checks=[no_heldout_check(rows, groups, p.heldout)],
        )
