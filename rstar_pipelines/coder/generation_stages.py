"""Stage kinds that generate the verification chain's material (rStar-Coder), for both
domains: synthesized_problems, test_inputs, candidate_solutions. Each is a thin
adapter; the method lives in the plain modules beside it (synthesis, test_inputs,
extract). The verifying stages are in verification_stages.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import Field

from rstar_pipelines.coder.extract import extract_final_answer, extract_program
from rstar_pipelines.coder.synthesis import (
    ParseFailure,
    normalized_text_hash,
    parse_synthesized_code,
    parse_synthesized_math,
)
from rstar_pipelines.coder.test_inputs import generate_inputs, parse_input_program
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.pipeline.generation import LLMStageParams, StageLLM
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import Stage, StageContext, StageResult, rows_of
from rstar_pipelines.seeds.parse import problem_id
from rstar_pipelines.storage import schemas

# -- synthesized_problems ----------------------------------------------------------------


class SynthesisParams(LLMStageParams):
    model: str = "synthesizer"
    # sampling.n is k, the new problems asked for per seed.
    sampling: SamplingParams = SamplingParams(n=2, temperature=0.8, max_tokens=512, seed=0)
    max_seeds_per_domain: int | None = Field(
        None, ge=0, description="synthesize from the first N seeds of each domain only"
    )


class ProblemSynthesis(Stage):
    """New problems written by the synthesizer model from each seed (code: from the
    problem and one oracle solution; math: from the problem), parsed, de-duplicated by
    normalized text, with the seed problems carried along (is_seed)."""

    Params = SynthesisParams
    schema = schemas.SYNTHESIZED_PROBLEMS
    prompt_roles = ("code", "math")
    resources = ("llm",)
    kinds = frozenset({"python", "llm"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        seeds = rows_of(inputs["seed_problems"])
        limit = self.params.max_seeds_per_domain
        sources = [
            s
            for domain in ("math", "code")
            for s in [s for s in seeds if s["domain"] == domain][:limit]
        ]
        prompts = [
            self.prompts["code"].render(problem=s["problem"], solution=s["oracle_solutions"][0])
            if s["domain"] == "code"
            else self.prompts["math"].render(problem=s["problem"])
            for s in sources
        ]
        llm = StageLLM(self, ctx)
        completions = llm.complete(prompts, self.params.sampling, ctx.cache)
        made = synthesized(seeds, sources, completions)
        rows = [{**s, "is_seed": True, "seed_id": s["id"], "model": None} for s in seeds]
        rows += [{**r, "batch": ctx.partition_key, "model": llm.name} for r in made.rows]
        asked = sum(len(o) for o in completions)
        ctx.log.info(
            "synthesized %d of %d completions; dropped: %s", len(made.rows), asked, made.failures
        )
        return StageResult(
            table=pa.Table.from_pylist(
                [{f: r.get(f) for f in self.schema.names} for r in rows], schema=self.schema
            ),
            metadata={
                "seed_problems": len(seeds),
                "completions": asked,
                "synthesized": len(made.rows),
                "yield": len(made.rows) / asked if asked else 0.0,
                "dropped": made.failures,
                "yield_per_seed": markdown_table(
                    ["seed", "domain", "completions", "kept"], made.yields
                ),
            },
        )


@dataclass
class Synthesized:
    """The problems parsed from the synthesizer's completions (without batch and model), the
    reasons completions were dropped, and per seed [id, domain, completions, kept]."""

    rows: list[dict]
    failures: dict[str, int]
    yields: list[list]


def synthesized(
    seeds: list[dict], sources: list[dict], completions: list[list[dict]]
) -> Synthesized:
    """The new problems of each source seed's completions: parsed, and kept only when their
    normalized text is new among the seeds and the problems kept before them."""
    seen = {normalized_text_hash(s["problem"]) for s in seeds}
    failures: Counter[str] = Counter()
    rows, yields = [], []
    for seed, outs in zip(sources, completions, strict=True):
        kept = 0
        for out in outs:
            parsed = (
                parse_synthesized_code(out["text"])
                if seed["domain"] == "code"
                else parse_synthesized_math(out["text"], seed["problem"])
            )
            if isinstance(parsed, ParseFailure):
                failures[parsed.reason] += 1
                continue
            text_hash = normalized_text_hash(parsed.problem)
            if text_hash in seen:
                failures["near-duplicate"] += 1
                continue
            seen.add(text_hash)
            kept += 1
            rows.append(
                {
                    "id": problem_id(seed["domain"], parsed.problem, None, []),
                    "domain": seed["domain"],
                    "problem": parsed.problem,
                    "answer": None,
                    "oracle_solutions": [],
                    "examples": [{"stdin": i, "stdout": o} for i, o in parsed.examples],
                    "time_limit_s": seed["time_limit_s"],
                    "is_seed": False,
                    "seed_id": seed["id"],
                }
            )
        yields.append([seed["id"], seed["domain"], len(outs), kept])
    return Synthesized(rows, dict(failures), yields)


# -- test_inputs --------------------------------------------------------------------------


class TestInputParams(LLMStageParams):
    model: str = "synthesizer"
    sampling: SamplingParams = SamplingParams(temperature=0.2, max_tokens=768, seed=0)
    target: int = Field(50, ge=1, description="valid inputs wanted per problem")
    timeout_s: float = Field(5.0, gt=0, description="per generator+validator run")
    memory_mb: int = Field(512, gt=0)


class TestInputGeneration(Stage):
    """Test inputs for each code problem, in rStar-Coder's three steps: the model writes
    an input generator, a validator and the scale grid; the sandbox runs the generator
    over the grid and the validator on every input; valid inputs are de-duplicated and
    kept (the problem's examples always). Math problems need no inputs."""

    Params = TestInputParams
    schema = schemas.TEST_INPUTS
    prompt_roles = ("program",)
    resources = ("llm", "sandbox")
    kinds = frozenset({"python", "llm", "docker"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        problems = rows_of(inputs["synthesized_problems"], "code")
        llm = StageLLM(self, ctx)
        prompts = [self.prompts["program"].render(problem=p["problem"]) for p in problems]
        sampling = self.params.sampling.model_copy(update={"n": 1})
        completions = llm.complete(prompts, sampling, ctx.cache)
        p = self.params

        def key(item: tuple[dict, str]) -> str:
            problem, text = item
            examples = [e["stdin"] for e in problem["examples"]]
            return fingerprint(text, examples, p.target, p.timeout_s, p.memory_mb)

        def compute(batch: list[tuple[dict, str]]) -> list[dict]:
            # The sandbox is started only when an item is not cached.
            return [test_inputs(prob, text, ctx.resource("sandbox").get, p) for prob, text in batch]

        items = [(prob, outs[0]["text"]) for prob, outs in zip(problems, completions, strict=True)]
        generated = ctx.cache.map(items, key, compute, chunk=1)
        rows = [
            {
                "problem_id": prob["id"],
                "batch": ctx.partition_key,
                "domain": "code",
                "model": llm.name,
                **gen,
            }
            for prob, gen in zip(problems, generated, strict=True)
        ]
        per_problem = [[r["problem_id"], r["generated"], r["valid"], r["kept"]] for r in rows]
        enough = sum(r["kept"] >= p.target for r in rows)
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "code_problems": len(rows),
                "unparsable_programs": sum(r["parse_error"] is not None for r in rows),
                f"problems_with_{p.target}_inputs": enough,
                "inputs_kept": sum(r["kept"] for r in rows),
                "per_problem": markdown_table(
                    ["problem", "generated", "valid", "kept"], per_problem
                ),
            },
        )


def test_inputs(problem: dict, text: str, sandbox: Callable[[], Any], p: TestInputParams) -> dict:
    """What one problem's input program (the model's completion `text`) yields: the kept inputs
    and the figures of its runs; the problem's examples alone when the program does not parse.
    `sandbox()` gives the sandbox that runs it."""
    program = parse_input_program(text)
    examples = [e["stdin"] for e in problem["examples"]]
    if program.error:
        return {
            "inputs": examples,
            "generated": 0,
            "valid": 0,
            "kept": len(examples),
            "largest_ok_scale": [],
            "generator": None,
            "parse_error": program.error,
            "errors": [],
        }
    gen = generate_inputs(
        program,
        sandbox(),
        examples=examples,
        target=p.target,
        timeout_s=p.timeout_s,
        memory_mb=p.memory_mb,
        seed=0,
    )
    return {
        "inputs": gen.inputs,
        "generated": gen.generated,
        "valid": gen.valid,
        "kept": gen.kept,
        "largest_ok_scale": [
            {"name": k, "value": v} for k, v in (gen.largest_ok_scale or {}).items()
        ],
        "generator": program.source,
        "parse_error": None,
        "errors": [f"{e.scale}: {e.status}: {e.message}" for e in gen.errors],
    }


# -- candidate_solutions ------------------------------------------------------------------


class CandidateParams(LLMStageParams):
    model: str = "solver"
    sampling: SamplingParams = SamplingParams(n=16, temperature=0.8, max_tokens=1024, seed=0)


class CandidateSolutions(Stage):
    """n long-CoT solutions per problem from the solver model: the program from the last
    fenced code block (code) or the final answer from the last \\boxed{} (math).
    Unparsable completions are kept, with the reason."""

    Params = CandidateParams
    schema = schemas.CANDIDATE_SOLUTIONS
    prompt_roles = ("code", "math")
    resources = ("llm",)
    kinds = frozenset({"python", "llm"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        problems = rows_of(inputs["synthesized_problems"])
        prompts = [self.prompts[p["domain"]].render(problem=p["problem"]) for p in problems]
        llm = StageLLM(self, ctx)
        completions = llm.complete(prompts, self.params.sampling, ctx.cache)
        rows = []
        for problem, outs in zip(problems, completions, strict=True):
            for index, out in enumerate(outs):
                if problem["domain"] == "code":
                    program, error = extract_program(out["text"])
                    answer = None
                else:
                    answer, error = extract_final_answer(out["text"])
                    program = None
                rows.append(
                    {
                        "id": fingerprint(problem["id"], index, out["text"])[:16],
                        "problem_id": problem["id"],
                        "batch": ctx.partition_key,
                        "domain": problem["domain"],
                        "candidate_index": index,
                        "text": out["text"],
                        "program": program,
                        "answer": answer,
                        "parse_error": error,
                        "finish_reason": out["finish_reason"],
                        "completion_tokens": out["completion_tokens"],
                        "model": llm.name,
                    }
                )
        errors = Counter(r["parse_error"] for r in rows if r["parse_error"])
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={
                "problems": len(problems),
                "candidates": len(rows),
                "parsed": len(rows) - sum(errors.values()),
                "parse_rate": (len(rows) - sum(errors.values())) / len(rows) if rows else 0.0,
                "unparsable": dict(errors),
                "mean_completion_tokens": (
                    sum(r["completion_tokens"] for r in rows) / len(rows) if rows else 0.0
                ),
            },
        )
