"""Stage kinds that verify: verified_outputs (mutual verification) and
verified_solutions (the SFT-ready rows of the candidates that agree)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.coder.verification import (
    WINDOW_JOBS,
    ProgramRuns,
    VerificationTask,
    determinism_mismatches,
    mutual_verify_streamed,
    run_programs,
)
from rstar_pipelines.math.answers import equivalent, majority_answer
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import histogram
from rstar_pipelines.pipeline.stage import (
    CheckOutcome,
    CheckSpec,
    Stage,
    StageContext,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.storage import schemas


class VerificationParams(StageParams):
    threshold: float = Field(0.6, gt=0, le=1, description="share of candidates that must agree")
    timeout_s: float = Field(2.0, gt=0, description="per run, unless the problem sets time_limit_s")
    memory_mb: int = Field(256, gt=0)
    window: int = Field(
        WINDOW_JOBS,
        ge=1,
        description="sandbox jobs queued at once, twice over: one window runs while the "
        "problems of the other are decided and committed, each as its last run ends",
    )
    determinism_sample: int = Field(5, ge=1, description="inputs re-run by the determinism check")


def _candidates_by_problem(table: pa.Table) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows_of(table):
        grouped[row["problem_id"]].append(row)
    return {pid: sorted(rows, key=lambda r: r["candidate_index"]) for pid, rows in grouped.items()}


def _verdict(candidate: dict, agrees: bool, status: str, timing: dict | None = None) -> dict:
    timing = timing or {}
    return {
        "candidate_id": candidate["id"],
        "candidate_index": candidate["candidate_index"],
        "agrees": agrees,
        "status": status,
        "answer": candidate["answer"],
        "wall_s": timing.get("wall_s"),
        "cpu_s": timing.get("cpu_s"),
        "peak_memory_mb": timing.get("peak_memory_mb"),
    }


class MutualVerification(Stage):
    """Labels by mutual verification. Code: every candidate runs on every test input;
    when enough candidates produce identical outputs on all of them, those outputs are
    the labels (a seed's oracle solution labels its own problem). Math: final answers
    are voted on with math-verify equivalence (a seed's given answer is the label).
    Unverified problems stay, with the reason."""

    Params = VerificationParams
    schema = schemas.VERIFIED_OUTPUTS
    resources = ("sandbox",)
    checks = (
        CheckSpec(
            "has_inputs_and_labels",
            "Every verified code problem has test inputs and one label per input.",
        ),
        CheckSpec(
            "labels_deterministic",
            "Re-running the labelling program on a sample of inputs reproduces the labels.",
        ),
    )
    kinds = frozenset({"python", "docker"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        problems = rows_of(inputs["synthesized_problems"])
        tests = {r["problem_id"]: r["inputs"] for r in rows_of(inputs["test_inputs"])}
        candidates = _candidates_by_problem(inputs["candidate_solutions"])
        code = [p for p in problems if p["domain"] == "code"]
        code_rows = self._verify_code(ctx, code, tests, candidates)
        math_rows = [
            self._verify_math(ctx, p, candidates.get(p["id"], []))
            for p in problems
            if p["domain"] == "math"
        ]
        rows = code_rows + math_rows
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata=_verification_figures(rows, {p["id"] for p in problems if p["is_seed"]}),
            checks=[
                self._check_labels(code_rows),
                self._check_determinism(ctx, code_rows, code, candidates),
            ],
        )

    def _verify_code(
        self,
        ctx: StageContext,
        problems: list[dict],
        tests: dict,
        candidates: dict[str, list[dict]],
    ) -> list[dict]:
        p = self.params
        tasks = [
            VerificationTask(
                candidates=tuple(c["program"] for c in candidates.get(prob["id"], [])),
                inputs=tuple(tests.get(prob["id"], [])),
                oracle=prob["oracle_solutions"][0] if prob["oracle_solutions"] else None,
                timeout_s=prob["time_limit_s"],
            )
            for prob in problems
        ]

        def key(task: VerificationTask) -> str:
            return fingerprint(asdict(task), p.threshold, p.timeout_s, p.memory_mb)

        def compute(todo: list[VerificationTask], done) -> None:
            mutual_verify_streamed(
                todo,
                ctx.resource("sandbox").get(),  # started only when an item is not cached
                lambda j, verification: done(j, asdict(verification)),
                threshold=p.threshold,
                timeout_s=p.timeout_s,
                memory_mb=p.memory_mb,
                window=p.window,
            )

        outcomes = ctx.cache.map_streamed(tasks, key, compute)
        rows = []
        for prob, task, mv in zip(problems, tasks, outcomes, strict=True):
            mine = candidates.get(prob["id"], [])
            verdicts = [
                _verdict(c, v["agrees"], v["status"], v)
                for c, v in zip(mine, mv["verdicts"], strict=True)
            ]
            rows.append(
                {
                    "problem_id": prob["id"],
                    "batch": ctx.partition_key,
                    "domain": "code",
                    "verified": mv["verified"],
                    "reason": mv["reason"],
                    "label_source": mv["label_source"],
                    "agreement": mv["agreement"],
                    "answer": None,
                    "inputs": list(task.inputs),
                    "labels": mv["labels"] if mv["verified"] else None,
                    "candidates": verdicts,
                }
            )
        return rows

    def _verify_math(self, ctx: StageContext, problem: dict, mine: list[dict]) -> dict:
        answers = [c["answer"] for c in mine]
        if problem["answer"] is not None:  # a seed: its given answer is the label
            agrees = [a is not None and equivalent(a, problem["answer"]) for a in answers]
            share = sum(agrees) / len(mine) if mine else 0.0
            verified, reason, source, answer = True, None, "given", problem["answer"]
        else:
            vote = majority_answer(answers, self.params.threshold)
            agrees = [i in vote.members and vote.accepted for i in range(len(mine))]
            share, verified, source, answer = vote.share, vote.accepted, "majority", vote.answer
            reason = (
                None
                if verified
                else (
                    f"best agreement {vote.share:.2f} < {self.params.threshold:.2f}"
                    if mine
                    else "no candidates"
                )
            )
        verdicts = [
            _verdict(c, ok, "ok" if c["answer"] is not None else "unparsable")
            for c, ok in zip(mine, agrees, strict=True)
        ]
        return {
            "problem_id": problem["id"],
            "batch": ctx.partition_key,
            "domain": "math",
            "verified": verified,
            "reason": reason,
            "label_source": source,
            "agreement": share,
            "answer": answer if verified else None,
            "inputs": None,
            "labels": None,
            "candidates": verdicts,
        }

    @staticmethod
    def _check_labels(rows: list[dict]) -> CheckOutcome:
        bad = [
            r["problem_id"]
            for r in rows
            if r["verified"] and (not r["inputs"] or len(r["labels"] or []) != len(r["inputs"]))
        ]
        return CheckOutcome(
            "has_inputs_and_labels",
            passed=not bad,
            metadata={
                "verified_code_problems": sum(r["verified"] for r in rows),
                "offending_problems": bad[:20],
            },
        )

    def _check_determinism(
        self,
        ctx: StageContext,
        rows: list[dict],
        problems: list[dict],
        candidates: dict[str, list[dict]],
    ) -> CheckOutcome:
        by_id = {p["id"]: p for p in problems}
        verified = [r for r in rows if r["verified"]]
        samples, checks = [], []
        for row in verified:  # one sandbox call for all: the workers never wait between them
            problem = by_id[row["problem_id"]]
            step = max(1, len(row["inputs"]) // self.params.determinism_sample)
            sample = list(range(0, len(row["inputs"]), step))[: self.params.determinism_sample]
            samples.append(sample)
            checks.append(
                ProgramRuns(
                    [_labelling_program(row, problem, candidates.get(row["problem_id"], []))],
                    [row["inputs"][i] for i in sample],
                    problem["time_limit_s"],
                )
            )
        runs = run_programs(
            checks, ctx.resource("sandbox").get(), self.params.timeout_s, self.params.memory_mb
        )
        unstable = [
            row["problem_id"]
            for row, sample, [reruns] in zip(verified, samples, runs, strict=True)
            if determinism_mismatches(reruns, [row["labels"][i] for i in sample])
        ]
        return CheckOutcome(
            "labels_deterministic",
            passed=not unstable,
            metadata={
                "problems_checked": len(verified),
                "nondeterministic_problems": unstable[:20],
            },
        )


def _verification_figures(rows: list[dict], seed_ids: set[str]) -> dict:
    """Seeds and synthesized problems apart: a seed is labelled by its own oracle or given
    answer (always verified), so only the synthesized problems measure mutual
    verification. For seeds, the agreement is the share of candidates that match the
    label: how well the solver solves them."""
    seeds = [r for r in rows if r["problem_id"] in seed_ids]
    synthesized = [r for r in rows if r["problem_id"] not in seed_ids]
    verified = Counter(r["domain"] for r in synthesized if r["verified"])
    reasons = Counter(r["reason"] for r in synthesized if not r["verified"])
    return {
        "problems": len(rows),
        "seed_problems": len(seeds),
        "synthesized_problems": len(synthesized),
        "synthesized_verified_code": verified["code"],
        "synthesized_verified_math": verified["math"],
        "synthesized_verification_rate": sum(verified.values()) / len(synthesized)
        if synthesized
        else 0.0,
        "unverified_reasons": dict(reasons),
        "synthesized_agreement": histogram(
            [r["agreement"] for r in synthesized],
            f"synthesized problems ({len(synthesized)}): candidate agreement",
            "share of candidates agreeing",
            ylabel="synthesized problems",
        ),
        "seed_candidates_matching_label": histogram(
            [r["agreement"] for r in seeds],
            f"seeds ({len(seeds)}): candidates matching the seed's label",
            "share of candidates matching",
            ylabel="seed problems",
        ),
    }


def _labelling_program(row: dict, problem: dict, mine: list[dict]) -> str:
    """The program whose outputs became the labels: the oracle, or an agreeing candidate."""
    if row["label_source"] == "oracle":
        return problem["oracle_solutions"][0]
    first = next(v for v in row["candidates"] if v["agrees"])
    return next(c["program"] for c in mine if c["id"] == first["candidate_id"])


class VerifiedSolutions(Stage):
    """The candidates that agree with the verified outputs or answer, as SFT-ready rows:
    problem, long-CoT text, program or answer, provenance, a chat `messages` column for
    trainers, and (code) the test cases in open-r1's `verification_info` layout."""

    schema = schemas.VERIFIED_SOLUTIONS
    kinds = frozenset({"python"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        problems = {p["id"]: p for p in rows_of(inputs["synthesized_problems"])}
        candidates = {c["id"]: c for c in rows_of(inputs["candidate_solutions"])}
        rows = []
        for outcome in rows_of(inputs["verified_outputs"]):
            if not outcome["verified"]:
                continue
            problem = problems[outcome["problem_id"]]
            info = None
            if outcome["domain"] == "code":
                cases = [
                    {"input": i, "output": o, "type": "stdin_stdout"}
                    for i, o in zip(outcome["inputs"], outcome["labels"], strict=True)
                ]
                info = {"language": "python", "test_cases": cases}
            for verdict in outcome["candidates"]:
                if not verdict["agrees"]:
                    continue
                candidate = candidates[verdict["candidate_id"]]
                rows.append(
                    {
                        "id": fingerprint("solution", candidate["id"])[:16],
                        "problem_id": problem["id"],
                        "candidate_id": candidate["id"],
                        "batch": ctx.partition_key,
                        "domain": problem["domain"],
                        "problem": problem["problem"],
                        "solution": candidate["text"],
                        "program": candidate["program"],
                        "answer": candidate["answer"] if problem["domain"] == "math" else None,
                        "messages": [
                            {"role": "user", "content": problem["problem"]},
                            {"role": "assistant", "content": candidate["text"]},
                        ],
                        "verification_info": info,
                        "agreement": outcome["agreement"],
                        "label_source": outcome["label_source"],
                        "cpu_s": verdict["cpu_s"],
                        "model": candidate["model"],
                    }
                )
        solved = {r["problem_id"] for r in rows}
        by_domain = Counter(r["domain"] for r in rows)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "solutions": len(rows),
                "code_solutions": by_domain["code"],
                "math_solutions": by_domain["math"],
                "problems_with_a_solution": len(solved),
            },
        )
