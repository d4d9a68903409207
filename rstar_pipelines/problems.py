"""The problems the pipeline learns from and is judged on: either side of the held-out split
(`heldout.HeldoutSplit`, declared once as `heldout:` in pipeline.yaml), and the verified problems
of the verification chain's tables.

The split is by group of near-duplicates. A seed, every problem synthesized from it, and every
problem of any batch whose normalized text (and answer) is the same or similar beyond the declared
threshold form one group (`problem_groups`), and a group falls on one side: the same problem in two
batches, or a paraphrase of an evaluation problem, is never trained on. Every stage that trains or
evaluates selects its problems here; every training table proves with the blocking check
`no_heldout_problems` that it holds none of the held-out side (docs/evaluation.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from rapidfuzz import fuzz, process

from rstar_pipelines.heldout import HeldoutSplit, normalized_answer, normalized_text
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import (
    CheckOutcome,
    CheckSpec,
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.storage import schemas

LEAK_EXAMPLES = 10


@dataclass(frozen=True)
class VerifiedProblem:
    """A problem the verification chain labelled: math with its verified final answer, code with
    verified test inputs and one label per input."""

    id: str
    seed_id: str
    group: str  # its near-duplicate group in problem_groups: the key the split hashes
    batch: str
    domain: str  # "math" or "code"
    question: str
    answer: str | None = None
    inputs: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


def seeds_of(synthesized_problems: pa.Table) -> dict[str, str]:
    """problem id -> the id of the seed it descends from (a seed's own id for a seed)."""
    return {r["id"]: r["seed_id"] for r in rows_of(synthesized_problems)}


def groups_of(problem_groups: pa.Table) -> dict[str, str]:
    """problem id -> its near-duplicate group (the key the split hashes), for every problem and
    seed of every batch."""
    return dict(
        zip(
            problem_groups.column("problem_id").to_pylist(),
            problem_groups.column("group_id").to_pylist(),
            strict=True,
        )
    )


def batch_groups(synthesized_problems: pa.Table, split: HeldoutSplit) -> dict[str, str]:
    """problem id -> its near-duplicate group among the problems of the table alone (one batch's:
    a batch's search draws its side from them, not waiting for every batch's problem_groups)."""
    grouped = near_duplicate_groups(rows_of(synthesized_problems), split.similarity)
    return {pid: g.group for pid, g in grouped.items()}


def verified_problems(
    inputs: dict[str, pa.Table], domain: str | None = None, groups: dict[str, str] | None = None
) -> list[VerifiedProblem]:
    """The verified problems of `verified_outputs` (of one domain, or both), with their text and
    seed from `synthesized_problems` and their group from `groups` (by default those of every
    batch, `problem_groups`), in the order verified_outputs holds them. A problem without a
    group is on neither side of the split."""
    synthesized = {r["id"]: r for r in rows_of(inputs["synthesized_problems"])}
    groups = groups_of(inputs["problem_groups"]) if groups is None else groups
    found = []
    for r in rows_of(inputs["verified_outputs"], domain):
        problem = synthesized.get(r["problem_id"])
        if not r["verified"] or problem is None or r["problem_id"] not in groups:
            continue
        common = {
            "id": r["problem_id"],
            "seed_id": problem["seed_id"],
            "group": groups[r["problem_id"]],
            "batch": r["batch"],
            "domain": r["domain"],
            "question": problem["problem"],
        }
        if r["domain"] == "math" and r["answer"]:
            found.append(VerifiedProblem(**common, answer=r["answer"]))
        elif r["domain"] == "code" and r["inputs"] and len(r["labels"] or []) == len(r["inputs"]):
            found.append(
                VerifiedProblem(**common, inputs=tuple(r["inputs"]), labels=tuple(r["labels"]))
            )
    return found


P = TypeVar("P")


def on_side(
    problems: Iterable[P], split: HeldoutSplit, heldout: bool, group_of=lambda p: p.group
) -> list[P]:
    """The problems on one side of the split (the held-out side, or the training side)."""
    return [p for p in problems if split.is_heldout(group_of(p)) == heldout]


# -- near-duplicate groups across every batch -------------------------------------------------

SIMILARITY_CHUNK = 1024  # query rows per rapidfuzz.cdist call: bounds its matrix's memory


class _Groups:
    """Union-find over problem ids, remembering why each id joined (the first link found)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.link: dict[str, tuple[str, float]] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str, similarity: float | None = None) -> None:
        if similarity is not None:
            self.link.setdefault(a, (b, similarity))
            self.link.setdefault(b, (a, similarity))
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass(frozen=True)
class GroupedProblem:
    id: str
    group: str  # the smallest seed id of its group: what the split hashes
    duplicate_of: str | None  # the problem it was found to duplicate (None: lineage only)
    similarity: float | None  # 1.0 for the same normalized text


def near_duplicate_groups(
    problems: Sequence[dict[str, Any]], similarity: float
) -> dict[str, GroupedProblem]:
    """Every problem's group: a seed with the problems synthesized from it, joined with every
    problem of the same domain (from any batch) whose normalized text is the same, or at least
    `similarity` alike with answers that do not differ (either unknown, or equal normalized).
    Rows are synthesized_problems' (id, domain, problem, answer, is_seed, seed_id)."""
    groups = _Groups()
    texts: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in problems:
        groups.union(row["id"], row["seed_id"])
        texts.setdefault((row["domain"], normalized_text(row["problem"])), []).append(row)
    answers = {
        key: {a for r in rows if (a := normalized_answer(r["answer"])) is not None}
        for key, rows in texts.items()
    }
    for rows in texts.values():
        for other in rows[1:]:
            if other["id"] != rows[0]["id"]:
                groups.union(rows[0]["id"], other["id"], 1.0)
    for domain in sorted({d for d, _ in texts}):
        keys = [k for k in texts if k[0] == domain]
        for a, b, score in _similar_pairs([k[1] for k in keys], similarity):
            if not answers[keys[a]] or not answers[keys[b]] or answers[keys[a]] & answers[keys[b]]:
                groups.union(texts[keys[a]][0]["id"], texts[keys[b]][0]["id"], score)
    seeds = {r["seed_id"] for r in problems}
    members: dict[str, list[str]] = {}
    for member in groups.parent:
        members.setdefault(groups.find(member), []).append(member)
    key_of = {root: min([m for m in ids if m in seeds] or ids) for root, ids in members.items()}
    return {
        r["id"]: GroupedProblem(
            r["id"], key_of[groups.find(r["id"])], *groups.link.get(r["id"], (None, None))
        )
        for r in problems
    }


def _similar_pairs(texts: Sequence[str], similarity: float) -> Iterable[tuple[int, int, float]]:
    """(i, j, similarity) for i < j of the texts at least `similarity` alike, by rapidfuzz's
    normalized Indel ratio, computed in chunks of rows on every core."""
    cutoff = similarity * 100
    for start in range(0, len(texts), SIMILARITY_CHUNK):
        scores = process.cdist(
            texts[start : start + SIMILARITY_CHUNK],
            texts,
            scorer=fuzz.ratio,
            score_cutoff=cutoff,
            dtype=np.float32,
            workers=-1,
        )
        for i, j in zip(*np.nonzero(scores >= cutoff), strict=True):
            if start + i < j:
                yield int(start + i), int(j), float(scores[i, j]) / 100


def first_of_each_domain(
    problems: Sequence[VerifiedProblem], limit: int | None
) -> list[VerifiedProblem]:
    """At most `limit` problems of each domain (all of them when None), math first, in order."""
    return [
        p
        for domain in ("math", "code")
        for p in [q for q in problems if q.domain == domain][:limit]
    ]


class GroupingParams(StageParams):
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader


GROUP_EXAMPLES = 10


class ProblemGrouping(Stage):
    """Near-duplicate groups over every batch of synthesized_problems: a seed with the problems
    written from it, joined with every problem of the same domain whose normalized text is the
    same or at least `heldout.similarity` alike, with answers that do not differ. The split
    draws groups, so the same problem in two batches (an answer written 5 and 5.0, other
    spacing, a paraphrase) falls on one side; every stage that trains or evaluates reads it."""

    Params = GroupingParams
    schema = schemas.PROBLEM_GROUPS

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        split = self.params.heldout
        rows = rows_of(inputs["synthesized_problems"])
        batches: dict[str, list[str]] = {}
        first: dict[str, dict] = {}
        for r in rows:
            batches.setdefault(r["id"], []).append(r["batch"])
            first.setdefault(r["id"], r)
        grouped = near_duplicate_groups(list(first.values()), split.similarity)
        sizes = Counter(g.group for g in grouped.values())
        table = [
            {
                "problem_id": g.id,
                "batches": sorted(set(batches[g.id])),
                "domain": first[g.id]["domain"],
                "seed_id": first[g.id]["seed_id"],
                "group_id": g.group,
                "group_size": sizes[g.group],
                "heldout": split.is_heldout(g.group),
                "duplicate_of": g.duplicate_of,
                "similarity": g.similarity,
            }
            for g in grouped.values()
        ]
        return StageResult(
            table=pa.Table.from_pylist(table, schema=self.schema),
            metadata={"split": split.describe(), **_group_figures(table)},
        )


def _group_figures(table: list[dict]) -> dict:
    """What a user checks: how many groups, which span batches, how many are held out."""
    members: dict[str, list[dict]] = {}
    for row in table:
        members.setdefault(row["group_id"], []).append(row)
    spanning = {
        g: rows for g, rows in members.items() if len({b for r in rows for b in r["batches"]}) > 1
    }
    duplicates = [r for r in table if r["duplicate_of"] is not None]
    examples = [
        [r["problem_id"], r["duplicate_of"], r["similarity"], r["group_id"], r["heldout"]]
        for r in duplicates[:GROUP_EXAMPLES]
    ]
    return {
        "problems": len(table),
        "groups": len(members),
        "heldout_groups": sum(rows[0]["heldout"] for rows in members.values()),
        "heldout_problems": sum(r["heldout"] for r in table),
        "groups_across_batches": len(spanning),
        "near_duplicates": len(duplicates),
        "near_duplicate_examples": markdown_table(
            ["problem", "duplicate of", "similarity", "group", "held out"], examples
        ),
    }


def heldout_problems(
    inputs: dict[str, pa.Table],
    split: HeldoutSplit,
    max_problems: int | None,
    stage: str,
    domain: str | None = None,
) -> list[VerifiedProblem]:
    """The verified problems (of one domain, or math and code) of the held-out split, at most
    `max_problems` of each domain, for the evaluation `stage`; an error naming it when there
    are none."""
    verified = verified_problems(inputs, domain)
    found = first_of_each_domain(on_side(verified, split, True), max_problems)
    if not found:
        which = f"{domain} problem" if domain else "problem"
        raise StageInputError(
            f"{stage}: no verified {which} of verified_outputs falls in the held-out split "
            f"(heldout.fraction={split.fraction}, salt {split.salt!r}): verify more "
            f"problems or raise heldout.fraction in pipeline.yaml"
        )
    return found


def evaluated_row(problem: VerifiedProblem, round_: int) -> dict[str, Any]:
    """The columns an evaluation's row opens with: which problem, where it comes from, and the
    answer it is graded against."""
    return {
        "problem_id": problem.id,
        "seed_id": problem.seed_id,
        "batch": problem.batch,
        "round": round_,
        "domain": problem.domain,
        "gold_answer": problem.answer,
    }


NO_HELDOUT_CHECK = CheckSpec(
    "no_heldout_problems",
    "No row comes from a held-out problem: every row names its problem, whose near-duplicate "
    "group (and its seed's) is on the training side of the split; rows of a source the table "
    "declares problem-free hold none of the held-out problems' texts.",
    blocking=True,
)


@dataclass(frozen=True)
class ProblemFreeSource:
    """Rows of a training table that name no problem (the texts of a file), declared by the
    table: the check lets them through only when no held-out problem's text is in them (the
    same, or at least the split's `similarity` alike, anywhere in the row's text)."""

    source: str  # the rows' `source` value
    heldout_texts: dict[str, str]  # held-out problem id -> its text


def heldout_texts(
    synthesized_problems: pa.Table, groups: dict[str, str], split: HeldoutSplit
) -> dict[str, str]:
    """problem id -> text of every problem on the held-out side (of every batch)."""
    return {
        r["id"]: r["problem"]
        for r in rows_of(synthesized_problems)
        if r["id"] in groups and split.is_heldout(groups[r["id"]])
    }


def no_heldout_check(
    rows: Sequence[dict[str, Any]],
    groups: dict[str, str],
    split: HeldoutSplit,
    problem_key: str = "problem_id",
    problem_free: ProblemFreeSource | None = None,
) -> CheckOutcome:
    """The blocking check of a training table. A row leaks when its problem's group (from
    problem_groups, not from the row) is held out, when the seed it names is held out or in
    another group than its problem, when its problem is unknown (it cannot be proven clean), or
    when it names no problem and is not of the table's declared problem-free source, or is and
    holds a held-out problem's text."""
    leaks: list[dict[str, Any]] = []
    free = [r for r in rows if r.get(problem_key) is None]
    for row in rows:
        problem_id, seed_id = row.get(problem_key), row.get("seed_id")
        if problem_id is None:
            if problem_free is None or row.get("source") != problem_free.source:
                declared = f"source {problem_free.source!r}" if problem_free else "none"
                why = f"names no problem (problem-free source declared: {declared})"
                leaks.append({"id": row.get("id"), "why": why})
            continue
        reasons = []
        group = groups.get(problem_id)
        if group is None:
            reasons.append("unknown problem (not in problem_groups)")
        elif split.is_heldout(group):
            reasons.append("held-out problem")
        if seed_id is not None:
            seed_group = groups.get(seed_id, seed_id)
            if split.is_heldout(seed_group):
                reasons.append("held-out seed")
            if group is not None and seed_group != group:
                reasons.append(f"seed {seed_id} is in group {seed_group}, its problem in {group}")
        if reasons:
            leaks.append({"problem_id": problem_id, "seed_id": seed_id, "why": "; ".join(reasons)})
    if problem_free is not None:
        leaks += _texts_holding_heldout_problems(free, problem_free, split.similarity)
    return CheckOutcome(
        NO_HELDOUT_CHECK.name,
        passed=not leaks,
        metadata={
            "rows_checked": len(rows),
            "rows_without_a_problem": len(free),
            "leaking_rows": len(leaks),
            "heldout_groups_known": len({g for g in groups.values() if split.is_heldout(g)}),
            "split": split.describe(),
            **({"first_leaks": leaks[:LEAK_EXAMPLES]} if leaks else {}),
        },
    )


def _texts_holding_heldout_problems(
    rows: Sequence[dict[str, Any]], declared: ProblemFreeSource, similarity: float
) -> list[dict[str, Any]]:
    """The declared problem-free rows in which a held-out problem's normalized text appears,
    whole or at least `similarity` alike (rapidfuzz's partial ratio)."""
    rows = [r for r in rows if r.get("source") == declared.source]
    if not rows or not declared.heldout_texts:
        return []
    ids = list(declared.heldout_texts)
    needles = [normalized_text(declared.heldout_texts[i]) for i in ids]
    haystacks = [normalized_text(_row_text(r)) for r in rows]
    cutoff = similarity * 100
    scores = process.cdist(
        needles, haystacks, scorer=fuzz.partial_ratio, score_cutoff=cutoff, workers=-1
    )
    leaks = []
    for j, row in enumerate(rows):
        found = [(float(scores[i, j]), ids[i]) for i in range(len(ids)) if scores[i, j] >= cutoff]
        if found:
            score, problem_id = max(found)
            leaks.append(
                {
                    "id": row.get("id"),
                    "why": f"holds held-out problem {problem_id}'s text (similarity "
                    f"{score / 100:.2f}) in a problem-free {declared.source!r} row",
                }
            )
    return leaks


def _row_text(row: dict[str, Any]) -> str:
    """A row's text, or its chat messages' contents one after another."""
    if row.get("text") is not None:
        return row["text"]
    return "\n".join(m["content"] for m in row.get("messages") or [])
