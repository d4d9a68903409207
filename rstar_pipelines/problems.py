"""The problems the pipeline learns from and is judged on: either side of the held-out split
(`heldout.HeldoutSplit`, declared once as `heldout:` in pipeline.yaml), and the verified problems
of the verification chain's tables.

The split is by seed. A seed problem and every problem synthesized from it fall on the same side,
so a paraphrase of an evaluation problem can never be trained on. Every stage that trains or
evaluates selects its problems here; every training table proves with the blocking check
`no_heldout_problems` that it holds none of the held-out side (docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.pipeline.stage import CheckOutcome, CheckSpec, rows_of

LEAK_EXAMPLES = 10


@dataclass(frozen=True)
class VerifiedProblem:
    """A problem the verification chain labelled: math with its verified final answer, code with
    verified test inputs and one label per input."""

    id: str
    seed_id: str
    batch: str
    domain: str  # "math" or "code"
    question: str
    answer: str | None = None
    inputs: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


def seeds_of(synthesized_problems: pa.Table) -> dict[str, str]:
    """problem id -> the id of the seed it descends from (a seed's own id for a seed)."""
    return {r["id"]: r["seed_id"] for r in rows_of(synthesized_problems)}


def verified_problems(
    inputs: dict[str, pa.Table], domain: str | None = None
) -> list[VerifiedProblem]:
    """The verified problems of `verified_outputs` (of one domain, or both), with their text and
    seed from `synthesized_problems`, in the order verified_outputs holds them."""
    synthesized = {r["id"]: r for r in rows_of(inputs["synthesized_problems"])}
    found = []
    for r in rows_of(inputs["verified_outputs"], domain):
        problem = synthesized.get(r["problem_id"])
        if not r["verified"] or problem is None:
            continue
        common = {
            "id": r["problem_id"],
            "seed_id": problem["seed_id"],
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
    problems: Iterable[P], split: HeldoutSplit, heldout: bool, seed_of=lambda p: p.seed_id
) -> list[P]:
    """The problems on one side of the split (the held-out side, or the training side)."""
    return [p for p in problems if split.is_heldout(seed_of(p)) == heldout]


def first_of_each_domain(
    problems: Sequence[VerifiedProblem], limit: int | None
) -> list[VerifiedProblem]:
    """At most `limit` problems of each domain (all of them when None), math first, in order."""
    return [
        p
        for domain in ("math", "code")
        for p in [q for q in problems if q.domain == domain][:limit]
    ]


NO_HELDOUT_CHECK = CheckSpec(
    "no_heldout_problems",
    "No row comes from a held-out problem: neither its problem id nor its seed is on the held-out "
    "side of the split, and every problem's seed is known from synthesized_problems.",
    blocking=True,
)


def no_heldout_check(
    rows: Sequence[dict[str, Any]],
    lineage: dict[str, str],
    split: HeldoutSplit,
    problem_key: str = "problem_id",
) -> CheckOutcome:
    """The blocking check of a training table. A row leaks when its problem is a held-out one (by
    its id: any problem whose seed, as synthesized_problems records it, is held out), when the
    seed it names is held out, or when its problem's lineage is unknown (it cannot be proven
    clean). Rows without a problem (e.g. texts from a file) are counted apart."""
    heldout_ids = {pid for pid, seed in lineage.items() if split.is_heldout(seed)}
    leaks: list[dict[str, Any]] = []
    without_problem = 0
    for row in rows:
        problem_id, seed_id = row.get(problem_key), row.get("seed_id")
        if problem_id is None:
            without_problem += 1
            continue
        reasons = []
        if problem_id in heldout_ids:
            reasons.append("held-out problem")
        if seed_id is not None and split.is_heldout(seed_id):
            reasons.append("held-out seed")
        if problem_id not in lineage:
            reasons.append("unknown problem (not in synthesized_problems)")
        elif seed_id is not None and lineage[problem_id] != seed_id:
            reasons.append(f"seed_id {seed_id} but synthesized_problems says {lineage[problem_id]}")
        if reasons:
            leaks.append({"problem_id": problem_id, "seed_id": seed_id, "why": "; ".join(reasons)})
    return CheckOutcome(
        NO_HELDOUT_CHECK.name,
        passed=not leaks,
        metadata={
            "rows_checked": len(rows),
            "rows_without_a_problem": without_problem,
            "leaking_rows": len(leaks),
            "heldout_problems_known": len(heldout_ids),
            "split": f"fraction {split.fraction}, salt {split.salt!r}",
            **({"first_leaks": leaks[:LEAK_EXAMPLES]} if leaks else {}),
        },
    )
