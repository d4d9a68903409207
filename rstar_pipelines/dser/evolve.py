"""DSER chains (docs/dser.md): s_0 = solve(x); each iteration the model verifies its
current solution and, unless its own verdict passes it, refines it given the critique.

A prompt holds only the problem, the current solution and (to refine) its critique, never the
history, so each chain is a Markov chain over solutions. All chains of all problems run at once
and none waits for another: a problem's first solutions are one request (n = chains), then each
chain verifies and refines as soon as its own completion is in (`llm.coroutines`); the new
states waiting to be graded go to `Judge.grade` together (for code: one sandbox run).

    runs = run_dser(llm, problems, DSERConfig(chains=4, iterations=8, vote_last=4),
                    DSERPrompts.from_templates(solve, verify, refine), Judge(sandbox))
    runs[0].vote_answer, runs[0].vote_correct
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rstar_pipelines.coder.extract import extract_program
from rstar_pipelines.coder.verification import (
    ProgramRuns,
    output_signature,
    passes_tests,
    run_programs,
)
from rstar_pipelines.dser.chain import ChainState
from rstar_pipelines.dser.vote import last_states, vote
from rstar_pipelines.llm.coroutines import (
    BYTES_PER_TOKEN,
    OPEN_MEMORY_MB,
    Ask,
    Batch,
    Coroutine,
    Fork,
    memory_bound,
    run_coroutines,
)
from rstar_pipelines.llm.types import LLM, Completion, SamplingParams
from rstar_pipelines.math.answers import equivalent, extract_boxed

__all__ = [
    "DOMAINS",
    "DSERConfig",
    "DSERProblem",
    "DSERPrompts",
    "DSERRun",
    "Grade",
    "Judge",
    "extract_answer",
    "parse_verdict",
    "run_dser",
]

DOMAINS = ("math", "code")


class DSERConfig(BaseModel):
    """Chains M, iterations T and the vote window K (the last K of the T+1 states)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chains: int = Field(4, ge=1, description="parallel chains per problem (M)")
    iterations: int = Field(8, ge=1, description="verify-refine iterations per chain (T)")
    vote_last: int = Field(
        4, ge=1, description="states per chain pooled into the vote: iterations T-K+1..T (K)"
    )
    solve_tokens: int = Field(1024, ge=1, description="most tokens of the first solution")
    verify_tokens: int = Field(512, ge=1, description="most tokens of one verification")
    refine_tokens: int = Field(1024, ge=1, description="most tokens of one refinement")
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _window_fits(self) -> DSERConfig:
        if self.vote_last > self.iterations + 1:
            raise ValueError(
                f"vote_last={self.vote_last} exceeds the {self.iterations + 1} states of a chain "
                f"(iterations={self.iterations} plus the first solution)"
            )
        return self

    def sampling(self, max_tokens: int, call: int, n: int = 1) -> SamplingParams:
        # A fresh seed per generate call, so that repeated phases do not repeat samples.
        seed = None if self.seed is None else self.seed + call
        return SamplingParams(
            n=n, temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens, seed=seed
        )


@dataclass(frozen=True)
class DSERProblem:
    """A math problem (gold `answer`) or a code problem (test `inputs` and, to grade,
    their expected outputs `labels`). Without a gold answer or labels states are not graded."""

    id: str
    domain: Literal["math", "code"]
    question: str
    answer: str | None = None
    inputs: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class DSERRun:
    """One problem's chains (chains[c][t] = s_t of chain c), the vote over the last
    `vote_last` states of all chains, the completion tokens and the number of completions
    (model calls) spent on it."""

    problem: DSERProblem
    chains: list[list[ChainState]]
    vote_answer: str | None
    vote_share: float
    vote_correct: bool | None
    tokens: int
    calls: int

    @property
    def correctness(self) -> list[list[bool | None]]:
        """Per chain, the grade of each state (the input of `markov.transition_counts`)."""
        return [[s.correct for s in chain] for chain in self.chains]


@dataclass(frozen=True)
class DSERPrompts:
    """The three prompt texts; each is sent as the single user message of a chat."""

    solve: Callable[[DSERProblem], str]
    verify: Callable[[DSERProblem, str], str]
    refine: Callable[[DSERProblem, str, str], str]

    @classmethod
    def from_templates(cls, solve: Any, verify: Any, refine: Any) -> DSERPrompts:
        """From templates with `render(**variables)` (pipeline `PromptTemplate`s); they see
        `domain` and `question`, plus `solution` (verify, refine) and `critique` (refine)."""
        return cls(
            solve=lambda p: solve.render(domain=p.domain, question=p.question),
            verify=lambda p, s: verify.render(domain=p.domain, question=p.question, solution=s),
            refine=lambda p, s, c: refine.render(
                domain=p.domain, question=p.question, solution=s, critique=c
            ),
        )


# The verify prompt asks for a last line "VERDICT: CORRECT" or "VERDICT: INCORRECT". Small
# models decorate it ("**Verdict:** correct", "VERDICT - INCORRECT"), so case and up to 8
# non-word characters between the word and the decision are accepted; the last one counts.
_VERDICT = re.compile(r"verdict\W{0,8}(incorrect|correct)\b", re.IGNORECASE)


def parse_verdict(critique: str) -> bool | None:
    """True for a final CORRECT verdict, False for INCORRECT, None when there is none."""
    found = _VERDICT.findall(critique)
    return found[-1].lower() == "correct" if found else None


def extract_answer(domain: str, text: str) -> str | None:
    if domain == "math":
        return extract_boxed(text)
    return extract_program(text)[0]


class Sandbox(Protocol):
    def run(self, jobs: Sequence[Any]) -> list[Any]: ...


@dataclass(frozen=True)
class Grade:
    correct: bool | None
    signature: tuple[str, ...] | None = None


class Judge:
    """Grades answers: math by `equivalent` with the gold answer; code by running every
    program on the problem's test inputs in the sandbox (all of one `grade` call in one
    sandbox run), correct when it prints the labels."""

    def __init__(
        self, sandbox: Sandbox | None = None, timeout_s: float = 2.0, memory_mb: int = 256
    ):
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    def grade(self, items: Sequence[tuple[DSERProblem, str | None]]) -> list[Grade]:
        code = [i for i, (problem, _) in enumerate(items) if problem.domain == "code"]
        code_grades = dict(zip(code, self._run_programs([items[i] for i in code]), strict=True))
        return [
            code_grades[i] if i in code_grades else _math_grade(problem, answer)
            for i, (problem, answer) in enumerate(items)
        ]

    def _run_programs(self, items: Sequence[tuple[DSERProblem, str | None]]) -> list[Grade]:
        if not items:
            return []
        if self.sandbox is None:
            raise ValueError("the judge has no sandbox to run code problems' programs")
        tasks = [ProgramRuns([program], problem.inputs) for problem, program in items]
        runs = run_programs(tasks, self.sandbox, self.timeout_s, self.memory_mb)
        return [
            Grade(passes_tests(r, problem.labels) if problem.labels else None, output_signature(r))
            for (problem, _), [r] in zip(items, runs, strict=True)
        ]


def _math_grade(problem: DSERProblem, answer: str | None) -> Grade:
    if problem.answer is None:
        return Grade(None)
    return Grade(answer is not None and equivalent(answer, problem.answer))


# A state's object, its dict and its numbers.
STATE_OVERHEAD_BYTES = 1024


def problem_bytes(config: DSERConfig) -> int:
    """The most one problem's chains hold while they run: every state's solution and
    verification at their token caps, and per chain one prompt in flight that carries a
    solution and its verification (the question aside: it is held once for the problem)."""
    solution = max(config.solve_tokens, config.refine_tokens) * BYTES_PER_TOKEN
    verification = config.verify_tokens * BYTES_PER_TOKEN
    states = 1 + config.iterations
    chain = states * (solution + verification + STATE_OVERHEAD_BYTES) + solution + verification
    return config.chains * chain


def run_dser(
    llm: LLM,
    problems: Sequence[DSERProblem],
    config: DSERConfig,
    prompts: DSERPrompts,
    judge: Judge,
    on_done: Callable[[int, DSERRun, float], None] | None = None,
    memory_mb: float = OPEN_MEMORY_MB,
) -> list[DSERRun]:
    """Evolve `config.chains` chains per problem for `config.iterations` iterations;
    `on_done(p, run, seconds)` as soon as problem p's chains have all ended, with its share of
    the wall time (llm.coroutines.Window). Problems start as the LLM has room for them, at most
    as many at once as `memory_mb` holds (`problem_bytes`).

    No chain stops early: a solution that passed is verified again in the next iteration,
    since the model's verdicts are samples too."""
    _check(problems)
    if not problems:
        return []
    evolution = _Evolution(llm, problems, config, prompts, judge)
    run_coroutines(
        llm,
        [evolution.problem(p) for p in range(len(problems))],
        {"grade": judge.grade},
        None if on_done is None else lambda p, seconds: on_done(p, evolution.result(p), seconds),
        window=memory_bound(problem_bytes(config), memory_mb),
    )
    return [evolution.result(p) for p in range(len(problems))]


class _Evolution:
    """All chains of all problems, each a coroutine that moves on when its own completions
    are in (`llm.coroutines`); the verification of iteration t is sampled with seed
    `seed + 2t - 1` and its refinement with `seed + 2t`, whatever the other chains do."""

    def __init__(
        self,
        llm: LLM,
        problems: Sequence[DSERProblem],
        config: DSERConfig,
        prompts: DSERPrompts,
        judge: Judge,
    ):
        self.llm, self.problems, self.config = llm, problems, config
        self.prompts, self.judge = prompts, judge
        self.chains: list[list[list[ChainState]]] = [
            [[] for _ in range(config.chains)] for _ in problems
        ]
        self.tokens = [0] * len(problems)
        self.calls = [0] * len(problems)

    def problem(self, p: int) -> Coroutine:
        """Solve (all chains' first solutions in one request), grade, then fork the chains."""
        c = self.config
        solved = yield Ask(
            _user(self.prompts.solve(self.problems[p])),
            c.sampling(c.solve_tokens, call=0, n=c.chains),
        )
        states = yield from self._new_states(p, solved, iteration=0)
        for chain, state in zip(self.chains[p], states, strict=True):
            chain.append(state)
        yield Fork([self.chain(p, chain) for chain in range(c.chains)])

    def chain(self, p: int, c: int) -> Coroutine:
        """Verify the current solution; unless it passed, refine it given the critique."""
        problem, states, config = self.problems[p], self.chains[p][c], self.config
        for t in range(1, config.iterations + 1):
            state = states[-1]
            [critique] = yield Ask(
                _user(self.prompts.verify(problem, state.text)),
                config.sampling(config.verify_tokens, call=2 * t - 1),
            )
            self._charge(p, critique)
            passed = parse_verdict(critique.text) is True
            states[-1] = replace(
                state, verdict=passed, tokens=state.tokens + critique.completion_tokens
            )
            if passed:
                states.append(replace(state, iteration=t, verdict=None, tokens=0))
                continue
            refined = yield Ask(
                _user(self.prompts.refine(problem, state.text, critique.text)),
                config.sampling(config.refine_tokens, call=2 * t),
            )
            [new] = yield from self._new_states(p, refined, iteration=t)
            states.append(new)

    def result(self, p: int) -> DSERRun:
        problem, chains = self.problems[p], self.chains[p]
        result = vote(last_states(chains, self.config.vote_last), problem.domain)
        return DSERRun(
            problem=problem,
            chains=chains,
            vote_answer=result.answer,
            vote_share=result.share,
            vote_correct=result.correct,
            tokens=self.tokens[p],
            calls=self.calls[p],
        )

    def _new_states(
        self, p: int, written: Sequence[Completion], iteration: int
    ) -> Generator[Batch, Any, list[ChainState]]:
        """New states s_iteration from these completions, graded in the judge's lane."""
        problem = self.problems[p]
        answers = []
        for out in written:
            self._charge(p, out)
            answers.append(extract_answer(problem.domain, out.text))
        grades = yield Batch("grade", [(problem, a) for a in answers])
        return [
            ChainState(
                iteration=iteration,
                text=out.text,
                answer=answer,
                verdict=None,
                correct=grade.correct,
                tokens=out.completion_tokens,
                signature=grade.signature,
            )
            for out, answer, grade in zip(written, answers, grades, strict=True)
        ]

    def _charge(self, p: int, completion: Completion) -> None:
        self.tokens[p] += completion.completion_tokens
        self.calls[p] += 1


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _check(problems: Sequence[DSERProblem]) -> None:
    seen = set()
    for problem in problems:
        where = f"DSER problem {problem.id!r}"
        if problem.id in seen:
            raise ValueError(f"{where} appears twice")
        seen.add(problem.id)
        if problem.domain not in DOMAINS:
            raise ValueError(f"{where}: domain {problem.domain!r} is not one of {DOMAINS}")
        if problem.domain == "code":
            if not problem.inputs:
                raise ValueError(f"{where}: a code problem needs test inputs to grade and vote")
            if problem.labels and len(problem.labels) != len(problem.inputs):
                raise ValueError(
                    f"{where}: {len(problem.labels)} labels for {len(problem.inputs)} inputs"
                )
