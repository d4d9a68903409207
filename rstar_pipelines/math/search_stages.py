"""Stage kinds of the rStar-Math search: mcts_trajectories (with the node table of every
tree), ppm_pairs and sft_dataset."""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from statistics import fmean
from typing import ClassVar, Literal

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.math.mcts import MCTSConfig, MCTSSearch, Problem, StepPrompt, Tree
from rstar_pipelines.math.pairs import best_trajectories, preference_pairs, trajectories
from rstar_pipelines.math.steps import assistant_text
from rstar_pipelines.math.tree import NODE, tree_from_rows
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import histogram
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.storage import schemas


def is_heldout(problem_id: str, fraction: float) -> bool:
    """A fixed split by problem id: the held-out problems are kept for evaluation."""
    digest = hashlib.sha256(problem_id.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) / 16**8 < fraction


def verified_math_problems(inputs: dict[str, pa.Table]) -> list[dict]:
    """Math problems with a verified final answer, with their text."""
    text = {r["id"]: r["problem"] for r in rows_of(inputs["synthesized_problems"])}
    return [
        {
            "id": r["problem_id"],
            "batch": r["batch"],
            "question": text[r["problem_id"]],
            "answer": r["answer"],
        }
        for r in rows_of(inputs["verified_outputs"], "math")
        if r["verified"] and r["answer"] and r["problem_id"] in text
    ]


def search_problems(inputs: dict[str, pa.Table], params, heldout: bool) -> list[dict]:
    """The verified math problems on one side of the held-out split, at most max_problems."""
    return [
        q
        for q in verified_math_problems(inputs)
        if is_heldout(q["id"], params.heldout_fraction) == heldout
    ][: params.max_problems]


class SearchStageParams(StageParams):
    model: str  # the policy's model role (round 1; later rounds search with the last policy)
    round: int = Field(1, ge=1)
    prompt: Literal["bootstrap", "policy"] = Field(
        "bootstrap",
        description="bootstrap: the few-shot prompt continued as raw text; policy: the chat "
        "format a trained policy learned (rounds >= 2)",
    )
    search: MCTSConfig = MCTSConfig()
    heldout_fraction: float = Field(0.2, ge=0, lt=1, description="problems kept for evaluation")
    max_problems: int | None = Field(None, ge=1, description="search at most this many")
    chunk: int = Field(16, ge=1, description="trees searched together (and per cache commit)")


class SearchModels:
    """The policy and PPM a search uses: a checkpoint's path when there is one (a
    later round, or an evaluation), else the stage's declared model and no PPM."""

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
        from rstar_pipelines.training.ppm import ProcessPreferenceModel

        return ProcessPreferenceModel.load(self.ppm_path)


def checkpoint_path(inputs: dict[str, pa.Table], name: str) -> str | None:
    if name not in inputs:
        return None
    rows = inputs[name].to_pylist()
    if not rows:
        raise StageInputError(f"{name} has no checkpoint row: train the previous round first")
    return rows[-1]["path"]


def step_prompt(stage: Stage, kind: str) -> StepPrompt:
    template = stage.prompts[kind]
    return StepPrompt(lambda q: template.render(question=q), chat=kind == "policy")


def search_trees(
    stage: Stage, ctx: StageContext, problems: list[dict], models: SearchModels, config
) -> tuple[list[Tree], list[float], dict]:
    """Search one tree per problem (cached per problem); the wall seconds of each tree
    (its chunk's time shared by the chunk's trees, stored with it so a cache hit keeps
    it) and the search's figures."""
    params = stage.params
    prompt = step_prompt(stage, params.prompt)
    searcher: list[MCTSSearch] = []

    def key(problem: dict) -> str:
        return fingerprint(
            "mcts-timed",
            models.policy_name,
            models.ppm_path,
            config.model_dump(mode="json"),
            stage.prompts[params.prompt].sha256,
            problem["question"],
            problem["answer"],
        )

    def compute(chunk: list[dict]) -> list[dict]:
        if not searcher:
            searcher.append(
                MCTSSearch(
                    models.policy(), ctx.resource("sandbox").get(), config, models.ppm(), prompt
                )
            )
        start = time.perf_counter()  # after loading the models: the search's own time
        found = searcher[0].run([Problem(p["id"], p["question"], p["answer"]) for p in chunk])
        seconds = (time.perf_counter() - start) / len(chunk)
        ctx.log.info(f"searched {len(chunk)} trees: {searcher[0].stats.as_dict()}")
        return [{"nodes": t.nodes.to_pylist(), "seconds": seconds} for t in found]

    stored = ctx.cache.map(problems, key, compute, params.chunk)
    trees = [
        Tree(Problem(p["id"], p["question"], p["answer"]), tree_from_rows(item["nodes"]))
        for p, item in zip(problems, stored, strict=True)
    ]
    seconds = [item["seconds"] for item in stored]
    return trees, seconds, (searcher[0].stats.as_dict() if searcher else {})


class SearchStage(Stage):
    """A stage that searches: it renders either prompt and needs a policy and a sandbox."""

    prompt_roles = ("bootstrap", "policy")
    resources = ("llm", "sandbox")
    kinds = frozenset({"python", "docker"})


class MCTSTrajectories(SearchStage):
    """MCTS over code-augmented CoT on the batch's verified math problems (less the
    held-out split): the completed trajectories with per-step Q-values, and the node
    table of every tree (`mcts_nodes`)."""

    Params = SearchStageParams
    schema = schemas.MCTS_TRAJECTORIES
    secondary_outputs: ClassVar[dict[str, pa.Schema]] = {"nodes": schemas.MCTS_NODES}

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        problems = search_problems(inputs, p, heldout=False)
        models = SearchModels(
            self,
            ctx,
            checkpoint_path(inputs, "previous_policy_checkpoint"),
            checkpoint_path(inputs, "previous_ppm_checkpoint"),
        )
        trees, _, stats = search_trees(self, ctx, problems, models, p.search)
        by_id = {q["id"]: q for q in problems}
        nodes, found = [], []
        for tree in trees:
            base = {
                "problem_id": tree.problem.id,
                "batch": by_id[tree.problem.id]["batch"],
                "round": p.round,
            }
            extra = {
                "question": tree.problem.question,
                "gold_answer": tree.problem.answer,
                "model": models.policy_name,
            }
            nodes += [{**base, **extra, **row} for row in tree.nodes.to_pylist()]
            for t in trajectories(tree):
                found.append(
                    {
                        "id": fingerprint(tree.problem.id, p.round, t.leaf.node_id)[:16],
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
                "trees": len(trees),
                "nodes": len(nodes),
                "trees_with_a_correct_answer": len(
                    {n["problem_id"] for n in answers if n["correct"]}
                ),
                "correct_terminals": sum(1 for n in answers if n["correct"]),
                "wrong_terminals": sum(1 for n in answers if not n["correct"]),
                "terminals_by_kind": dict(kinds),
                **{f"search_{k}": v for k, v in stats.items()},
            },
        )


def stored_trees(nodes: pa.Table) -> list[Tree]:
    """The trees of a node table, one per (batch, problem)."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in nodes.to_pylist():
        grouped[(row["batch"], row["problem_id"])].append(row)
    trees = []
    for (_, problem_id), rows in sorted(grouped.items()):
        problem = Problem(problem_id, rows[0]["question"], rows[0]["gold_answer"])
        trees.append(
            Tree(problem, tree_from_rows([{k: r.get(k) for k in NODE.names} for r in rows]))
        )
    return trees


class PairParams(StageParams):
    round: int = Field(1, ge=1)
    min_margin: float = Field(0.5, ge=0, description="least Q difference of a kept pair")
    min_edit_distance: int = Field(20, ge=0, description="least Levenshtein distance, in chars")


class PreferencePairs(Stage):
    """Step-level preference pairs from every searched tree (spec §2.2), in TRL's
    reward layout: prompt, chosen, rejected, margin."""

    Params = PairParams
    schema = schemas.PPM_PAIRS

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        batch_of = {r["problem_id"]: r["batch"] for r in rows_of(inputs["mcts_nodes"])}
        rows = []
        trees = stored_trees(inputs["mcts_nodes"])
        for tree in trees:
            for pair in preference_pairs(tree, p.min_margin, p.min_edit_distance):
                rows.append(
                    {
                        "id": fingerprint(tree.problem.id, p.round, pair.chosen, pair.rejected)[
                            :16
                        ],
                        "problem_id": tree.problem.id,
                        "batch": batch_of[tree.problem.id],
                        "round": p.round,
                        **{k: getattr(pair, k) for k in schemas.PPM_PAIRS.names[4:]},
                    }
                )
        kinds = Counter(r["kind"] for r in rows)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "trees": len(trees),
                "trees_with_pairs": len({r["problem_id"] for r in rows}),
                "step_pairs": kinds["step"],
                "final_pairs": kinds["final"],
                "margin_distribution": histogram(
                    [r["margin"] for r in rows], "pair margins", "Q margin", value_range=(0, 2)
                ),
            },
        )


class SFTParams(StageParams):
    round: int = Field(1, ge=1)
    per_problem: int = Field(2, ge=1, description="best correct trajectories kept per problem")


class SFTDataset(Stage):
    """Policy fine-tuning data as chat messages: the best correct trajectories of each
    tree by mean then minimum Q (spec §3), plus the verified solutions."""

    Params = SFTParams
    schema = schemas.SFT_DATASET
    prompt_roles = ("policy",)

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        user = self.prompts["policy"]
        batch_of = {r["problem_id"]: r["batch"] for r in rows_of(inputs["mcts_nodes"])}
        rows = []
        for tree in stored_trees(inputs["mcts_nodes"]):
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
                        "batch": batch_of[tree.problem.id],
                        "round": p.round,
                        "domain": "math",
                        "messages": messages,
                        "mean_q": fmean(t.q_values),
                        "min_q": min(t.q_values),
                    }
                )
        from_trees = len(rows)
        for r in rows_of(inputs["verified_solutions"]):
            rows.append(
                {
                    "id": r["id"],
                    "source": "verified_solutions",
                    "problem_id": r["problem_id"],
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
            metadata={"from_trees": from_trees, "from_verified_solutions": len(rows) - from_trees},
        )
